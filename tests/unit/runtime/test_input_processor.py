"""The input processor on its own: every prompt form it takes, the request it builds, and each
refusal with its field named (the same refusals through the engine: test_engine_requests.py)."""

from __future__ import annotations

import pytest

from kunlun_runtime.engine.input_processor import InputProcessor
from kunlun_runtime.engine.sampling_params import SamplingParams
from kunlun_runtime.errors import InvalidRequestError
from kunlun_runtime.models.tokenizer import Tokenizer
from tests.support.tiny_models import VOCAB_SIZE, build_tokenizer

MAX_MODEL_LEN = 16


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    build_tokenizer().save(str(directory / "tokenizer.json"))
    return Tokenizer(directory)


@pytest.fixture
def inputs(tokenizer):
    return InputProcessor(tokenizer, VOCAB_SIZE, MAX_MODEL_LEN)


def test_every_prompt_form_gives_its_text_and_ids(inputs, tokenizer):
    ids = tokenizer.encode("abc")
    assert len(ids) == 3
    assert inputs.tokenize("abc") == ("abc", ids)
    assert inputs.tokenize({"prompt": "abc"}) == ("abc", ids)
    assert inputs.tokenize([5, 6]) == (None, [5, 6])
    assert inputs.tokenize({"prompt_token_ids": ["7", 8]}) == (None, [7, 8])
    assert inputs.tokenize({"prompt": "shown", "prompt_token_ids": [7]}) == ("shown", [7])


@pytest.mark.parametrize("prompt", [3.5, [1, "2"], None])
def test_anything_else_is_refused_naming_the_prompt(inputs, prompt):
    with pytest.raises(InvalidRequestError, match="prompt: must be a string or a list of token ids") as error:
        inputs.tokenize(prompt)
    assert error.value.field == "prompt" and error.value.status_code == 400


def test_the_request_carries_the_budget_and_what_the_caller_gave(inputs):
    text, request = inputs.make_request(
        "r1", [1, 2, 3], SamplingParams(max_tokens=5), priority=2, cache_salt="t", arrival_time=7.5
    )
    assert text is None
    assert (request.request_id, request.prompt_token_ids, request.max_total_tokens) == ("r1", [1, 2, 3], 8)
    assert (request.priority, request.cache_salt, request.arrival_time) == (2, "t", 7.5)
    _, unbounded = inputs.make_request("r2", [1, 2, 3], SamplingParams(max_tokens=None))
    assert unbounded.max_total_tokens == MAX_MODEL_LEN and unbounded.arrival_time > 0


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([], "prompt: must not be empty"),
        ("", "prompt: must not be empty"),
        ([1, VOCAB_SIZE, -1, 2], r"prompt: token ids out of range: \[320, -1\]"),
        (list(range(MAX_MODEL_LEN)), "maximum context length is 16 tokens, but the prompt has 16 tokens"),
    ],
)
def test_a_prompt_that_cannot_be_served_is_refused(inputs, prompt, message):
    with pytest.raises(InvalidRequestError, match=message) as error:
        inputs.make_request("r", prompt, SamplingParams(max_tokens=None))
    assert error.value.field == "prompt"


@pytest.mark.parametrize(
    ("params", "field", "message"),
    [
        (SamplingParams(max_tokens=5), "max_tokens",
         r"^max_tokens: 5 is too large: this model's maximum context length is 16 tokens and the request "
         r"has 12 input tokens \(5 > 16 - 12\)$"),
        (SamplingParams(max_tokens=None, min_tokens=5), "min_tokens",
         r"^min_tokens: 5 is too large: .* has 12 input tokens \(5 > 16 - 12\)$"),
    ],
)  # fmt: skip
def test_budgets_beyond_the_context_are_refused_not_cut_short(inputs, params, field, message):
    with pytest.raises(InvalidRequestError, match=message) as error:
        inputs.make_request("r", list(range(12)), params)
    assert error.value.field == field
    _, request = inputs.make_request("r", list(range(12)), SamplingParams(max_tokens=4, min_tokens=4))
    assert request.max_total_tokens == MAX_MODEL_LEN

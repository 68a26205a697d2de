"""Request bodies → engine parameters: defaults, vLLM extras, bounds, n > 1 seeding, error params."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kunlun_runtime.engine.sampling_params import (
    MAX_NUM_STOP_STRINGS,
    MAX_NUM_STOP_TOKEN_IDS,
    MAX_STOP_STRING_CHARS,
    SamplingParams,
)
from kunlun_runtime.errors import InvalidRequestError
from kunlun_runtime.server.completions import _prompts
from kunlun_runtime.server.errors import APIError, param_from_location
from kunlun_runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from kunlun_runtime.server.request_building import children, sampling_params
from kunlun_runtime.server.served_model import ServedModel

SERVED = ServedModel(engine=None, name="m", max_model_len=64, vocab_size=100, root="/models/m")  # type: ignore[arg-type]
USER = [{"role": "user", "content": "hi"}]


def test_completion_defaults_follow_openai() -> None:
    body = CompletionRequest(prompt="x")
    params = sampling_params(body, SERVED, max_tokens=body.max_tokens, logprobs=body.logprobs)
    assert (params.n, params.max_tokens, params.temperature, params.top_p, params.logprobs) == (
        1,
        16,
        1.0,
        1.0,
        None,
    )


def test_chat_has_no_default_token_limit_and_prefers_max_completion_tokens() -> None:
    assert ChatCompletionRequest(messages=USER).max_tokens is None
    body = ChatCompletionRequest(messages=USER, max_tokens=9, max_completion_tokens=3)
    assert body.max_completion_tokens == 3


def test_vllm_extra_fields_reach_the_sampling_params() -> None:
    body = ChatCompletionRequest.model_validate(
        {"messages": USER, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 2,
         "ignore_eos": True, "stop_token_ids": [7], "stop": "END", "seed": 3, "priority": -1}
    )  # fmt: skip
    params = sampling_params(body, SERVED, max_tokens=8, logprobs=None)
    assert (params.top_k, params.min_p, params.repetition_penalty, params.min_tokens) == (5, 0.1, 1.2, 2)
    assert params.ignore_eos and params.stop_token_ids == [7] and params.stop == ["END"] and params.seed == 3
    assert body.priority == -1


def test_unknown_fields_are_ignored() -> None:
    body = ChatCompletionRequest.model_validate({"messages": USER, "tools": [], "user": "u", "whatever": 1})
    assert not hasattr(body, "whatever")


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", float("inf")), ("top_p", float("nan")), ("n", 0), ("n", 129), ("seed", 2**64),
     ("repetition_penalty", 1e-9), ("top_logprobs", 21), ("max_tokens", 0)],
)  # fmt: skip
def test_out_of_bounds_values_are_rejected_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate({"messages": USER, field: value})
    assert caught.value.errors()[0]["loc"] == (field,)


def test_stop_token_ids_must_be_in_the_vocabulary() -> None:
    body = ChatCompletionRequest(messages=USER, stop_token_ids=[100])
    with pytest.raises(InvalidRequestError) as caught:
        sampling_params(body, SERVED, max_tokens=4, logprobs=None)
    assert caught.value.field == "stop_token_ids"


def test_sampling_params_validation_names_the_field() -> None:
    body = ChatCompletionRequest(messages=USER, min_tokens=9)
    with pytest.raises(InvalidRequestError) as caught:
        sampling_params(body, SERVED, max_tokens=4, logprobs=None)
    assert caught.value.field == "min_tokens"


def test_n_children_are_seeded_seed_plus_index_and_carry_priority() -> None:
    body = ChatCompletionRequest(messages=USER, n=3, seed=10, priority=2)
    params = sampling_params(body, SERVED, max_tokens=4, logprobs=None)
    kids = children("req", "p", params, body)
    assert [k.request_id for k in kids] == ["req-0", "req-1", "req-2"]
    assert [k.params.seed for k in kids] == [10, 11, 12]
    assert {k.params.n for k in kids} == {1} and {k.priority for k in kids} == {2}


def test_unseeded_children_stay_unseeded() -> None:
    body = ChatCompletionRequest(messages=USER, n=2)
    kids = children("r", "p", sampling_params(body, SERVED, max_tokens=4, logprobs=None), body)
    assert [k.params.seed for k in kids] == [None, None]


def test_chat_content_parts_are_joined_text() -> None:
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
            ]
        }
    )
    assert body.conversation() == [{"role": "user", "content": "ab"}]


def test_completion_prompts_normalise_to_a_list() -> None:
    assert _prompts("x") == ["x"]
    assert _prompts(["x", "y"]) == ["x", "y"]
    assert _prompts([1, 2]) == [[1, 2]]
    assert _prompts([[1], [2, 3]]) == [[1], [2, 3]]
    with pytest.raises(InvalidRequestError):
        _prompts([])


def test_error_param_is_the_field_path_without_the_body() -> None:
    assert param_from_location(("body", "messages", 0, "content")) == "messages.0.content"
    assert param_from_location(("body",)) is None
    assert param_from_location(["body", "temperature"]) == "temperature"


def test_unknown_model_is_404_and_no_model_means_the_served_one() -> None:
    SERVED.check_model(None)
    SERVED.check_model("m")
    with pytest.raises(APIError) as caught:
        SERVED.check_model("other")
    assert caught.value.status_code == 404 and caught.value.param == "model"


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"stop": ["s"] * (MAX_NUM_STOP_STRINGS + 1)}, "stop", "at most 64 stop strings are allowed, got 65"),
        ({"stop": ["x" * (MAX_STOP_STRING_CHARS + 1)]}, "stop", "at most 256 characters, got 257"),
        ({"stop_token_ids": [1] * (MAX_NUM_STOP_TOKEN_IDS + 1)}, "stop_token_ids", "at most 128 stop token ids"),
    ],
)  # fmt: skip
def test_stop_conditions_are_bounded_naming_the_field(fields: dict, field: str, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message) as caught:
        SamplingParams(**fields)
    assert caught.value.field == field and caught.value.status_code == 400
    at_limit = SamplingParams(
        stop=["x" * MAX_STOP_STRING_CHARS] * MAX_NUM_STOP_STRINGS, stop_token_ids=[1] * MAX_NUM_STOP_TOKEN_IDS
    )
    assert len(at_limit.stop) == MAX_NUM_STOP_STRINGS


@pytest.mark.parametrize(
    ("body", "location"),
    [
        ({"prompt": "a\ud800"}, ("prompt",)),
        ({"prompt": ["ok", "\udfff"]}, ("prompt",)),
        ({"prompt": "ok", "stop": "\ud800"}, ("stop",)),
        ({"prompt": "ok", "cache_salt": "\ud800"}, ("cache_salt",)),
    ],
)
def test_a_lone_surrogate_is_refused_naming_the_field(body: dict, location: tuple) -> None:
    with pytest.raises(ValidationError) as caught:
        CompletionRequest.model_validate(body)
    assert caught.value.errors()[0]["loc"] == location
    assert "must be valid Unicode text" in caught.value.errors()[0]["msg"]
    assert CompletionRequest.model_validate({"prompt": "héllo 🙂"}).prompt == "héllo 🙂"

"""Offline logprobs in vLLM's shape: per position a dict ``token_id -> Logprob`` holding the chosen
token (first) and the top-N, with vocabulary ranks, the values of an independent forward's
log-softmax, and each token decoded on its own with its special tokens kept."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import kunlun_runtime
from kunlun_runtime import LLM, SamplingParams
from kunlun_runtime.engine.logprobs import Logprob
from tests.support.tiny_models import make_tiny_model

PROMPT = [5, 17, 99, 3, 250, 8]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("logprobs") / "tiny")


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), dtype="float32", max_model_len=64, kv_cache_memory="4MiB")


@pytest.fixture(scope="module")
def reference(model_dir):
    """HF transformers' FP32 forward: row i of ``reference(ids)`` is the log-softmax of the
    distribution of the token after ``ids[i]``."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def log_softmax(token_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([token_ids])).logits[0].float(), dim=-1)

    return log_softmax


def decode(llm: LLM, token_id: int) -> str:
    return llm.tokenizer.decode([token_id], skip_special_tokens=False)


def expected_position(llm: LLM, row: torch.Tensor, chosen: int, num_top: int) -> dict[int, Logprob]:
    """vLLM's dict for one position of the reference distribution ``row``: the chosen token with
    its vocabulary rank, then the top ``num_top`` with ranks 1..N (one entry per token)."""
    position = {chosen: Logprob(row[chosen].item(), int((row > row[chosen]).sum()) + 1, decode(llm, chosen))}
    values, ids = torch.topk(row, num_top)
    for rank, (token_id, value) in enumerate(zip(ids.tolist(), values.tolist(), strict=True), start=1):
        position[token_id] = Logprob(value, rank, decode(llm, token_id))
    return position


def assert_position(got: dict[int, Logprob], want: dict[int, Logprob]) -> None:
    assert list(got) == list(want)  # the same tokens: the chosen one first, then by rank
    for token_id, entry in want.items():
        assert isinstance(got[token_id], Logprob)
        assert (got[token_id].rank, got[token_id].decoded_token) == (entry.rank, entry.decoded_token)
        assert got[token_id].logprob == pytest.approx(entry.logprob, abs=1e-4)


def chosen(completion) -> list[Logprob]:
    """The generated tokens' own entries, in order."""
    return [p[t] for p, t in zip(completion.logprobs, completion.token_ids, strict=True)]


def generation_rows(reference, prompt: list[int], token_ids: list[int]) -> torch.Tensor:
    """The reference distributions of each generated token (the row before it)."""
    return reference(prompt + token_ids[:-1])[len(prompt) - 1 :]


def test_greedy_tokens_rank_first_and_each_dict_holds_exactly_the_top_n(llm, reference):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    completion = llm.generate({"prompt_token_ids": PROMPT}, params)[0].outputs[0]
    rows = generation_rows(reference, PROMPT, completion.token_ids)
    assert len(completion.logprobs) == len(completion.token_ids) == 6
    for position, token_id, row in zip(completion.logprobs, completion.token_ids, rows, strict=True):
        assert next(iter(position)) == token_id and position[token_id].rank == 1
        assert len(position) == 3 and set(position) == set(torch.topk(row, 3).indices.tolist())
        assert_position(position, expected_position(llm, row, token_id, 3))
    assert completion.cumulative_logprob == pytest.approx(sum(e.logprob for e in chosen(completion)))
    assert completion.cumulative_logprob == pytest.approx(
        sum(row[t].item() for row, t in zip(rows, completion.token_ids, strict=True)), abs=1e-3
    )


def test_a_sampled_token_outside_the_top_n_is_added_with_its_vocabulary_rank(llm, reference):
    # Temperature 5 flattens the distribution: the seeded draws land far from the top token.
    params = SamplingParams(temperature=5.0, seed=7, max_tokens=8, ignore_eos=True, logprobs=1)
    completion = llm.generate({"prompt_token_ids": PROMPT}, params)[0].outputs[0]
    rows = generation_rows(reference, PROMPT, completion.token_ids)
    for position, token_id, row in zip(completion.logprobs, completion.token_ids, rows, strict=True):
        assert_position(position, expected_position(llm, row, token_id, 1))
        assert len(position) == (1 if position[token_id].rank == 1 else 2)
    assert [len(p) for p in completion.logprobs].count(2) >= 1  # the case this test is about
    assert all(
        e.rank > 1 for p, e in zip(completion.logprobs, chosen(completion), strict=True) if len(p) == 2
    )
    assert completion.cumulative_logprob == pytest.approx(sum(e.logprob for e in chosen(completion)))


def test_logprobs_zero_gives_the_sampled_token_alone(llm, reference):
    params = SamplingParams(temperature=5.0, seed=3, max_tokens=4, ignore_eos=True, logprobs=0)
    completion = llm.generate({"prompt_token_ids": PROMPT}, params)[0].outputs[0]
    rows = generation_rows(reference, PROMPT, completion.token_ids)
    for position, token_id, row in zip(completion.logprobs, completion.token_ids, rows, strict=True):
        assert list(position) == [token_id]
        assert position[token_id].rank == int((row > row[token_id]).sum()) + 1


def test_prompt_logprobs_start_with_none_then_hold_each_prompt_token(llm, reference):
    im_start = llm.tokenizer.token_to_id("<|im_start|>")
    the = llm.tokenizer.token_to_id("Ġthe")
    prompt = [5, im_start, 17, the, 99, 3]
    output = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    rows = reference(prompt)
    assert len(output.prompt_logprobs) == len(prompt) and output.prompt_logprobs[0] is None
    for index in range(1, len(prompt)):
        assert_position(
            output.prompt_logprobs[index], expected_position(llm, rows[index - 1], prompt[index], 2)
        )
    assert output.prompt_logprobs[1][im_start].decoded_token == "<|im_start|>"  # special tokens kept
    assert output.prompt_logprobs[3][the].decoded_token == " the"
    assert output.outputs[0].logprobs is None and output.outputs[0].cumulative_logprob is None


def test_without_logprobs_there_are_none(llm):
    output = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=2))[0]
    assert output.outputs[0].logprobs is None and output.outputs[0].cumulative_logprob is None
    assert output.prompt_logprobs is None


def test_every_choice_and_every_streamed_output_carries_the_same_shape(llm):
    params = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=5, ignore_eos=True, logprobs=1)
    streamed: dict[str, list] = {}
    output = llm.generate(
        {"prompt_token_ids": PROMPT},
        params,
        on_output=lambda o: streamed.setdefault(o.request_id, []).append(o.outputs[0].logprobs),
    )[0]
    assert len(output.outputs) == 2
    for completion in output.outputs:
        assert [next(iter(p)) for p in completion.logprobs] == completion.token_ids
    for request_id, steps in streamed.items():
        final = output.outputs[int(request_id.rsplit("-", 1)[1])].logprobs  # offline-<call>-<choice>
        assert [len(s) for s in steps] == [1, 2, 3, 4, 5]  # one more position per step
        assert all(step == final[: len(step)] for step in steps)


def test_logprob_is_exported_with_vllms_fields_and_defaults():
    assert kunlun_runtime.Logprob is Logprob
    assert Logprob(-0.5) == Logprob(logprob=-0.5, rank=None, decoded_token=None)

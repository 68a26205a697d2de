"""benchmarks/engine_batches.py: requests kept in flight are timed only over the steps in which
all of them decode."""

import pytest

from kunlun_runtime import LLM, SamplingParams
from tests.support.benchmark_scripts import load_benchmark
from tests.support.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def engine_batches():
    return load_benchmark("engine_batches")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def _prompts(count: int) -> list[list[int]]:
    return [[5 + index, 9, 17 + index % 3, 4, 11 + index] for index in range(count)]


def test_plain_decode_in_flight_times_each_full_step_and_nothing_else(engine_batches, model_dir):
    llm = LLM(str(model_dir), dtype="float32", max_num_seqs=16)
    try:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        timing = engine_batches.run_in_flight(llm.engine, _prompts(12), params, 4)
        # 12 prompts, 4 in flight, all 6 tokens long: three waves, each a prefill step (its first
        # token) and 5 steps decoding all 4; every timed step emits one token per request.
        assert timing.decode_steps == 3 * 5
        assert timing.decode_tokens == 4 * timing.decode_steps
        assert timing.decode_seconds > 0 and timing.requests == 12
        assert not llm.engine.has_unfinished_requests()
    finally:
        llm.close()


def test_a_request_that_finishes_early_is_replaced_and_the_gap_not_timed(engine_batches, model_dir):
    llm = LLM(str(model_dir), dtype="float32", max_num_seqs=16)
    try:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        engine = llm.engine
        added = []
        add = engine.add_request

        def recording_add(request_id, prompt, request_params, **kwargs):
            added.append(request_id)
            # the third prompt stops after 2 tokens: a slot frees while the others decode
            short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
            return add(request_id, prompt, short if len(added) == 3 else request_params, **kwargs)

        engine.add_request = recording_add
        timing = engine_batches.run_in_flight(engine, _prompts(5), params, 4)
        assert len(added) == 5
        # Wave: prefill of 4 (untimed), 1 full step (the short one's 2nd token: it finishes), then
        # the fifth's prefill beside 3 decodes (untimed), then 4 decode together until the first
        # three finish (their 6th token: 3 more steps), after which fewer than 4 remain (untimed).
        assert timing.decode_steps == 1 + 3
        assert timing.decode_tokens == 4 * timing.decode_steps
    finally:
        llm.close()


def test_fewer_prompts_than_in_flight_is_an_error(engine_batches):
    with pytest.raises(ValueError, match="at least 8 prompts"):
        engine_batches.run_in_flight(None, _prompts(3), None, 8)


def test_a_closed_batch_times_each_request_from_its_first_token_to_its_last(engine_batches, model_dir):
    llm = LLM(str(model_dir), dtype="float32", max_num_seqs=16)
    try:
        engine = llm.engine
        add = engine.add_request
        added = []

        def recording_add(request_id, prompt, request_params, **kwargs):
            added.append(request_id)  # the second prompt stops after 2 tokens, the others run 8
            short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
            return add(request_id, prompt, short if len(added) == 2 else request_params, **kwargs)

        engine.add_request = recording_add
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        timing = engine_batches.run_batch(engine, _prompts(3), params)
        assert timing.decode_tokens == 7 + 1 + 7
        assert timing.request_decode_steps == 7 + 1 + 7  # no drafts: one token a step
        short, *full = sorted(timing.request_decode_seconds)
        # The short one decoded one step, the others seven; the batch lasted as long as they did.
        assert 0 < short < min(full) and max(full) <= timing.decode_seconds
        assert timing.request_decode_tok_s == pytest.approx(15 / sum(timing.request_decode_seconds))
        assert timing.request_decode_tok_s > timing.decode_tokens / (3 * timing.decode_seconds)
    finally:
        llm.close()


def test_a_closed_batch_counts_each_request_step_once_however_many_drafts_it_accepted(
    engine_batches, model_dir
):
    """With speculation a step's accepted drafts come back as outputs of their own; a request's
    decode step is still one step: its decode tokens are its steps plus the drafts it accepted."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    llm = LLM(str(model_dir), dtype="float32", max_num_seqs=16, speculative_config=spec)
    try:
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        # Repeating prompts: the tiny model's greedy text repeats too, so drafts get accepted.
        prompts = [[5, 6, 7, 8] * 20, [9, 10, 11] * 25]
        accepted_before = llm.engine.spec.counters.totals()[2]
        timing = engine_batches.run_batch(llm.engine, prompts, params)
        accepted = llm.engine.spec.counters.totals()[2] - accepted_before
        assert accepted > 0
        assert timing.decode_tokens == 2 * 39
        assert timing.request_decode_steps == timing.decode_tokens - accepted
    finally:
        llm.close()

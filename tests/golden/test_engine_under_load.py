"""The engine under load (property-based): random arrivals, lengths and priorities on a tiny KV
pool. Every request finishes, equals the same request run alone (FP32), nobody is preempted more
than max_preemptions times, and every block is free at the end. Under both scheduling policies."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kunlun_runtime import LLM, SamplingParams

MAX_PREEMPTIONS = 2
BLOCK = 8
# 2 layers × (K, V) × stride of one 8-token block (8 × 2 heads × 16 dims × 4 B = 1 KiB + 1 line).
BLOCK_BYTES_ALL_LAYERS = 2 * 2 * (1024 + 64)


def make_llm(model_dir, num_blocks, policy="fixed", target_step_seconds=None):
    llm = LLM(
        str(model_dir),
        dtype="float32",
        block_size=BLOCK,
        max_model_len=64,
        max_num_batched_tokens=24,
        kv_cache_memory_bytes=num_blocks * BLOCK_BYTES_ALL_LAYERS,
        max_preemptions=MAX_PREEMPTIONS,
        priority_aging_steps=8,
        scheduling_policy=policy,
        target_step_seconds=target_step_seconds,
    )
    engine = llm.engine
    assert engine.scheduler.policy.name == policy
    return llm


# feedback-tight: a 1 µs target, so every prefill beside a decode is cut to the minimum chunk.
POLICIES = {"fixed": ("fixed", None), "feedback": ("feedback", None), "feedback-tight": ("feedback", 1e-6)}


@pytest.fixture(scope="module", params=sorted(POLICIES))
def engines(request, tiny_model_dirs):
    model_dir = tiny_model_dirs["llama-gqa"]
    policy, target = POLICIES[request.param]
    small = make_llm(model_dir, num_blocks=10, policy=policy, target_step_seconds=target)
    return small, make_llm(model_dir, num_blocks=64)


request_strategy = st.tuples(
    st.integers(1, 30),  # prompt length
    st.integers(1, 20),  # max tokens
    st.integers(0, 3),  # priority
    st.integers(0, 6),  # arrival step
    st.integers(0, 299),  # first token
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(request_strategy, min_size=1, max_size=8))
def test_random_workload_finishes_batch_invariant_without_leaks(engines, workload):
    small, roomy = engines
    engine = small.engine
    prompts = [[(first + 13 * i) % 300 for i in range(length)] for length, _, _, _, first in workload]
    params = [
        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for _, max_tokens, *_ in workload
    ]
    alone = [
        roomy.generate({"prompt_token_ids": p}, sp)[0].outputs[0].token_ids
        for p, sp in zip(prompts, params, strict=True)
    ]

    pending = sorted(range(len(workload)), key=lambda i: workload[i][3])
    finished, preemptions, step = {}, {}, 0
    while pending or engine.has_unfinished_requests():
        while pending and workload[pending[0]][3] <= step:
            i = pending.pop(0)
            engine.add_request(f"r{i}", {"prompt_token_ids": prompts[i]}, params[i], priority=workload[i][2])
        for request in engine.scheduler.running + engine.scheduler.waiting:
            preemptions[request.request_id] = request.num_preemptions
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
        step += 1
        assert step < 2000, "engine made no progress"
    assert finished == {f"r{i}": alone[i] for i in range(len(workload))}
    assert max(preemptions.values()) <= MAX_PREEMPTIONS
    assert engine.block_pool.num_free == engine.block_pool.num_blocks


def test_stream_of_short_high_priority_requests_does_not_starve_a_long_low_priority_one(engines):
    engine = engines[0].engine
    engine.add_request(
        "long",
        {"prompt_token_ids": list(range(1, 31))},
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        priority=9,
    )
    long_done_at = None
    for step in range(400):
        if step % 2 == 0:
            engine.add_request(
                f"short-{step}",
                {"prompt_token_ids": [3, 4, 5, 6, 7, 8, 9, 10, 11]},
                SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                priority=0,
            )
        if any(o.request_id == "long" and o.finished for o in engine.step()):
            long_done_at = step
            break
    assert long_done_at is not None, "the long low-priority request starved"
    for request in list(engine.scheduler.running + engine.scheduler.waiting):
        engine.abort_request(request.request_id)
    assert engine.block_pool.num_free == engine.block_pool.num_blocks


def test_tiny_pool_really_preempts_and_outputs_still_match(engines):
    small, roomy = engines
    prompts = [[(7 * i + k) % 300 for i in range(20)] for k in range(4)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    before = small.engine.scheduler.num_preemptions_total
    got = [o.outputs[0].token_ids for o in small.generate([{"prompt_token_ids": p} for p in prompts], params)]
    want = [
        o.outputs[0].token_ids for o in roomy.generate([{"prompt_token_ids": p} for p in prompts], params)
    ]
    assert small.engine.scheduler.num_preemptions_total > before
    assert got == want
    assert small.engine.block_pool.num_free == small.engine.block_pool.num_blocks

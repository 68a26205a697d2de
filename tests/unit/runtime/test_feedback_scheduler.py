"""The feedback scheduling policy, without a model: prefill chunks capped by the step-time model,
the token budget kept for decodes, small requests merged, bounded overtaking of a request waiting
for memory, prefix-resident requests first, and the fairness guarantees under adversarial input."""

import argparse
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kunlun_runtime.config import EngineConfig
from kunlun_runtime.engine.request import Request, RequestStatus
from kunlun_runtime.engine.sampling_params import SamplingParams
from kunlun_runtime.engine.scheduler import Scheduler, SchedulerLimits
from kunlun_runtime.engine.step_cost import StepFeatures
from kunlun_runtime.errors import ConfigError
from kunlun_runtime.kv.block_pool import BlockPool
from kunlun_runtime.kv.kv_manager import KVManager
from kunlun_runtime.options.flags import add_engine_args, engine_config_from_args
from tests.support.scheduling import run_step, summary

# Synthetic device: 10 ms per step, 0.1 ms per prefill token, 1 ms per decode, attention free.
COST = (0.010, 1e-4, 1e-3, 0.0, 0.0, 0.0, 0.0)


def make_scheduler(
    policy="feedback",
    *,
    num_blocks=256,
    block=16,
    max_num_seqs=16,
    budget=512,
    max_preemptions=3,
    aging=1000,
    caching=False,
    target=None,
    trained=True,
    cost=COST,
):
    kv = KVManager(BlockPool(num_blocks), block, enable_prefix_caching=caching)
    limits = SchedulerLimits(max_num_seqs, budget, max_preemptions, aging, policy, target)
    scheduler = Scheduler(limits, kv)
    if trained:
        rng = random.Random(0)
        for _ in range(40):
            prefill = rng.randint(1, 2048) if rng.random() < 0.6 else 0  # pure-decode steps too
            features = StepFeatures(prefill, rng.randint(0, 64), rng.randint(0, 4_000_000))
            scheduler.cost.observe(features, sum(c * x for c, x in zip(cost, features.row(), strict=True)))
    return scheduler


def make_request(request_id, prompt_len, max_tokens=8, priority=0, first_token=10):
    prompt = [(first_token + i) % 1000 for i in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    return Request(request_id, prompt, params, max_total_tokens=prompt_len + max_tokens, priority=priority)


def start_decoding(scheduler, *names, prompt_len=4, max_tokens=50):
    for name in names:
        scheduler.add(make_request(name, prompt_len, max_tokens=max_tokens, priority=1))
    run_step(scheduler)


def test_a_long_prompt_is_capped_to_the_target_while_decodes_run_and_goes_whole_without_them():
    capped = make_scheduler(target=0.03005)
    start_decoding(capped, "d1", "d2")
    capped.add(make_request("doc", 500))
    # 2 decodes = 12 ms predicted; 0.1 ms per prefill token fits 180 tokens under 30.05 ms.
    assert summary(run_step(capped)) == [("d1", 1), ("d2", 1), ("doc", 180)]
    assert summary(run_step(capped)) == [("doc", 180), ("d1", 1), ("d2", 1)]
    alone = make_scheduler(target=0.03005)
    alone.add(make_request("doc", 500))
    assert summary(run_step(alone)) == [("doc", 500)]


def test_without_a_target_the_cap_is_three_decode_steps_of_the_learned_model():
    # A slow platform: 2 decodes take 120 ms, so 3 decode steps (360 ms) exceed the 0.3 s floor.
    scheduler = make_scheduler(max_num_seqs=8, cost=(0.1, 1e-3, 1e-2, 0.0, 0.0, 0.0, 0.0))
    start_decoding(scheduler, "d1", "d2")
    scheduler.add(make_request("doc", 1000))
    # (360 - 120) / 1 = 240 tokens, but the last one lands on the boundary.
    chunk = dict(summary(run_step(scheduler)))["doc"]
    assert chunk in (239, 240)
    assert scheduler.policy.step_target(StepFeatures(0, 2, 0)) == pytest.approx(0.36, rel=1e-6)


def test_without_a_target_a_fast_platform_gets_the_floor_of_the_target():
    # 2 decodes take 12 ms here: 3 of them would cap chunks at 240 tokens; the 0.3 s floor allows
    # (300 - 12) / 0.1 = 2880.
    scheduler = make_scheduler(max_num_seqs=8, num_blocks=512, budget=8192)
    assert scheduler.policy.step_target(StepFeatures(0, 2, 0)) == pytest.approx(0.3)
    start_decoding(scheduler, "d1", "d2")
    scheduler.add(make_request("doc", 5000))  # whole, 512 ms: more than the merge slack
    assert dict(summary(run_step(scheduler)))["doc"] in (2879, 2880)


def test_a_chunk_that_leaves_the_decode_path_is_at_least_worth_its_fixed_price():
    # A step with any prefill costs 20 ms more (the per-layer path instead of the fused decode
    # call): a 36 ms target would allow (36 - 12 - 20) / 0.1 = 40 tokens, a step spent mostly on
    # that price. The chunk is at least c_mixed / c_prefill = 200 tokens instead.
    scheduler = make_scheduler(max_num_seqs=8, target=0.036, cost=(0.010, 1e-4, 1e-3, 0.0, 0.020, 0.0, 0.0))
    assert scheduler.policy.amortized_chunk() == 200
    start_decoding(scheduler, "d1", "d2")
    scheduler.add(make_request("doc", 1000))
    assert dict(summary(run_step(scheduler)))["doc"] == 200


def test_without_a_target_a_fixed_price_of_mixed_steps_buys_chunks_worth_four_prices():
    # Derived target: max(3 × 120 ms, 120 ms + 5 × 200 ms, 0.3 s) = 1.12 s, so the chunk's own
    # work is (1120 - 120 - 200) ms = 4 × the 200 ms price: 800 tokens at 1 ms.
    scheduler = make_scheduler(max_num_seqs=8, budget=4096, cost=(0.1, 1e-3, 1e-2, 0.0, 0.2, 0.0, 0.0))
    assert scheduler.policy.step_target(StepFeatures(0, 2, 0)) == pytest.approx(1.12, rel=1e-6)
    start_decoding(scheduler, "d1", "d2")
    scheduler.add(make_request("doc", 2000))  # whole, it would take 2.32 s: more than the merge slack
    assert dict(summary(run_step(scheduler)))["doc"] in (799, 800)  # the last one on the boundary


def test_before_any_measurement_feedback_caps_nothing():
    scheduler = make_scheduler(trained=False)
    start_decoding(scheduler, "d1")
    scheduler.add(make_request("doc", 500))
    assert summary(run_step(scheduler)) == [("d1", 1), ("doc", 500)]


def test_a_high_priority_prefill_leaves_one_token_per_decode_where_fixed_takes_the_whole_budget():
    outcomes = {}
    for policy in ("fixed", "feedback"):
        scheduler = make_scheduler(policy, budget=8, trained=False)
        start_decoding(scheduler, "d1", "d2", prompt_len=2)
        scheduler.add(make_request("p", 20, priority=0))
        run_step(scheduler)
        outcomes[policy] = summary(run_step(scheduler))
    assert outcomes == {"fixed": [("p", 8)], "feedback": [("p", 6), ("d1", 1), ("d2", 1)]}


def test_small_requests_are_merged_past_the_target_up_to_the_slack():
    scheduler = make_scheduler(target=0.03005)
    start_decoding(scheduler, "d1", "d2")
    scheduler.add(make_request("a-doc", 500))  # same arrival step: ties go by id, the document first
    for name in ("c1", "c2", "c3", "c4"):
        scheduler.add(make_request(name, 40))
    # doc takes the target (180); each chat adds 4 ms up to 1.5 × 30.05 ms: c1..c3 fit, c4 waits.
    expected = [("d1", 1), ("d2", 1), ("a-doc", 180), ("c1", 40), ("c2", 40), ("c3", 40)]
    assert summary(run_step(scheduler)) == expected
    assert [r.request_id for r in scheduler.waiting] == ["c4"]


def overtaking_scenario(policy, aging=2, protect=False):
    """R holds 8 of 12 blocks; B needs 6 and waits for memory; a 1-block request S arrives each step."""
    scheduler = make_scheduler(policy, num_blocks=12, block=4, budget=32, aging=aging, trained=False)
    scheduler.add(make_request("R", 28, max_tokens=20))
    run_step(scheduler)
    blocked = make_request("B", 24, first_token=500)
    blocked.protected = protect
    scheduler.add(blocked)
    admitted = []
    for step in range(1, 5):
        scheduler.add(make_request(f"S{step}", 3, max_tokens=1, first_token=100 * step))
        admitted.append([name for name, _ in summary(run_step(scheduler)) if name != "R"])
    return admitted, scheduler


def test_a_small_request_overtakes_one_that_waits_for_memory_only_until_it_has_waited_aging_steps():
    admitted, scheduler = overtaking_scenario("feedback", aging=2)
    assert admitted == [["S1"], ["S2"], [], []]
    assert [r.request_id for r in scheduler.waiting] == ["B", "S3", "S4"]


def test_with_slow_aging_overtaking_still_stops_after_sixteen_waiting_steps():
    scheduler = make_scheduler(num_blocks=40, block=4, budget=128, aging=1000, trained=False)
    scheduler.add(make_request("R", 100, max_tokens=30))
    run_step(scheduler)  # R holds 26 of 40 blocks and grows by one every 4 steps
    scheduler.add(make_request("B", 60, first_token=500))  # needs 15 blocks: never fits meanwhile
    admitted = []
    for step in range(1, 21):
        scheduler.add(make_request(f"S{step}", 3, max_tokens=1, first_token=100 + 10 * step))
        admitted.append([name for name, _ in summary(run_step(scheduler)) if name != "R"])
    assert admitted == [[f"S{step}"] for step in range(1, 17)] + [[]] * 4


def test_fixed_policy_never_overtakes():
    admitted, _ = overtaking_scenario("fixed")
    assert admitted == [[], [], [], []]


def test_a_protected_request_is_never_overtaken():
    admitted, _ = overtaking_scenario("feedback", aging=100, protect=True)
    assert admitted == [[], [], [], []]


def test_among_equals_the_request_with_resident_prefix_blocks_goes_first_and_is_not_double_counted():
    order = {}
    for policy in ("fixed", "feedback"):
        scheduler = make_scheduler(policy, block=4, max_num_seqs=1, caching=True, trained=False)
        scheduler.add(make_request("warm", 12, max_tokens=1, first_token=300))
        run_step(scheduler)  # finished; its three full blocks stay in the prefix cache
        scheduler.add(make_request("cold", 12, first_token=700))
        scheduler.add(make_request("hit", 12, first_token=300))
        queries_before = scheduler.kv.num_prefix_queries
        order[policy] = summary(run_step(scheduler))
        assert scheduler.kv.num_prefix_queries - queries_before == 12  # only the admitted one was looked up
    # "hit" reuses two full blocks (its last token is always computed) and computes 4 tokens.
    assert order == {"fixed": [("cold", 12)], "feedback": [("hit", 4)]}


def running(scheduler, request, num_computed, num_allocated):
    """Put ``request`` in the running set with ``num_computed`` tokens and room for ``num_allocated``."""
    request.num_computed_tokens = 0
    assert scheduler.kv.allocate(request, num_allocated)
    request.num_computed_tokens = num_computed
    request.status = RequestStatus.RUNNING
    scheduler.running.append(request)


def test_a_prefill_left_out_for_time_keeps_its_blocks_against_a_lower_ranked_decode():
    scheduler = make_scheduler(num_blocks=10, block=4, budget=64, target=1e-6)
    running(scheduler, make_request("A", 40, priority=0), num_computed=8, num_allocated=24)
    running(scheduler, make_request("P", 40, priority=1), num_computed=8, num_allocated=8)
    decode = make_request("D", 8, priority=2)
    decode.output_token_ids.append(1)
    running(scheduler, decode, num_computed=8, num_allocated=8)  # its 9th token needs a third block
    out = scheduler.schedule()
    # A, the first prefill, gets the minimum chunk; P gets no time; D finds no free block and may
    # not take P's (P ranks above it), so D preempts itself.
    assert summary(out) == [("A", 16)]
    assert [r.request_id for r in out.preempted] == ["D"]
    assert scheduler.kv.block_ids("P") != [] and [r.request_id for r in scheduler.running] == ["A", "P"]


def test_a_decode_with_drafts_counts_one_decode_row_and_a_draft_row_per_draft():
    # d1 has computed its 4 prompt tokens and sampled one: it decodes position 4 and verifies
    # drafts at 5, 6 and 7, each a one-token row priced apart from a decode row (its attention
    # re-reads the keys of the row before it).
    scheduler = make_scheduler(trained=False)
    start_decoding(scheduler, "d1")
    scheduler.running[0].spec_token_ids.extend([7, 8, 9])
    out = scheduler.schedule()
    assert summary(out) == [("d1", 4)]
    assert out.features == StepFeatures(0, 1, 5, 3, 6 + 7 + 8)


def test_update_from_output_feeds_the_cost_model_with_the_step_composition():
    scheduler = make_scheduler(trained=False)
    start_decoding(scheduler, "d1")
    doc = make_request("doc", 30)
    scheduler.add(doc)
    out = scheduler.schedule()
    assert out.features == StepFeatures(30, 1, 5 + 30 * 30)
    scheduler.update_from_output(out, 0.25)
    assert scheduler.cost.num_observations == 1
    assert scheduler.cost.predict(out.features) == pytest.approx(0.25, rel=1e-6)
    assert doc.num_computed_tokens == 30  # the scheduler advanced what it scheduled


def test_an_untimed_step_advances_requests_but_teaches_the_cost_model_nothing():
    scheduler = make_scheduler(trained=False)
    doc = make_request("doc", 30)
    scheduler.add(doc)
    scheduler.update_from_output(scheduler.schedule(), elapsed_seconds=None)
    assert doc.num_computed_tokens == 30
    assert scheduler.cost.num_observations == 0


workload = st.lists(
    st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 3), st.integers(0, 10)),
    min_size=1,
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(workload, st.sampled_from([0.012, 0.02, 0.05]), st.integers(6, 14))
def test_feedback_under_adversarial_load_finishes_everyone_within_the_preemption_bound(
    jobs, target, num_blocks
):
    scheduler = make_scheduler(
        num_blocks=num_blocks, block=4, budget=16, max_num_seqs=6, max_preemptions=2, aging=4, target=target
    )
    pending = sorted(range(len(jobs)), key=lambda i: jobs[i][3])
    requests = {}
    step = 0
    while pending or scheduler.num_unfinished:
        while pending and jobs[pending[0]][3] <= step:
            i = pending.pop(0)
            prompt_len, max_tokens, priority, _ = jobs[i]
            prompt_len = min(prompt_len, num_blocks * 4 - 1)  # the engine refuses what cannot fit
            max_tokens = max(1, min(max_tokens, num_blocks * 4 - prompt_len))
            requests[i] = make_request(f"r{i}", prompt_len, max_tokens, priority, first_token=i)
            scheduler.add(requests[i])
        run_step(scheduler)
        assert all(r.num_preemptions <= 2 for r in requests.values())
        step += 1
        assert step < 3000, "no progress"
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in requests.values())
    assert scheduler.kv.pool.num_free == num_blocks


def test_a_stream_of_short_high_priority_requests_does_not_starve_a_long_low_priority_one():
    scheduler = make_scheduler(num_blocks=16, block=4, budget=16, max_num_seqs=4, aging=8, target=0.012)
    scheduler.add(make_request("long", 40, max_tokens=20, priority=9))
    for step in range(600):
        if step % 2 == 0:
            scheduler.add(make_request(f"short-{step}", 6, max_tokens=6, priority=0, first_token=step))
        run_step(scheduler)
        if scheduler.kv.holds("long") is False and not any(r.request_id == "long" for r in scheduler.waiting):
            break
    else:
        pytest.fail("the long low-priority request starved")
    assert step < 600


def parse_engine_flags(*flags):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args(list(flags)))


def test_the_policy_and_target_come_from_the_flags_and_reach_the_scheduler_limits():
    config = parse_engine_flags("--scheduling-policy", "feedback", "--target-step-seconds", "0.25")
    assert (config.scheduling_policy, config.target_step_seconds) == ("feedback", 0.25)
    assert SchedulerLimits.from_config(config) == SchedulerLimits(64, 2048, 3, 256, "feedback", 0.25)
    default = parse_engine_flags()
    assert (default.scheduling_policy, default.target_step_seconds) == ("fixed", None)


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"scheduling_policy": "adaptive"}, "scheduling_policy"),
        ({"target_step_seconds": 0.0}, "target_step_seconds"),
        ({"target_step_seconds": -1.0}, "target_step_seconds"),
        ({"target_step_seconds": float("nan")}, "target_step_seconds"),
    ],
)
def test_invalid_scheduling_options_are_refused_naming_the_field(options, field):
    with pytest.raises(ConfigError, match=f"^{field}: ") as error:
        EngineConfig(**options).validate()
    assert error.value.field == field

"""Scheduler policy, without a model: budgets, chunked prefill, preemption, protection, aging."""

from kunlun_runtime.engine.request import Request, RequestStatus
from kunlun_runtime.engine.sampling_params import SamplingParams
from kunlun_runtime.engine.scheduler import Scheduler, SchedulerLimits
from kunlun_runtime.kv.block_pool import BlockPool
from kunlun_runtime.kv.kv_manager import KVManager
from tests.support.scheduling import run_step, summary

BLOCK = 4


def make_scheduler(num_blocks=16, max_num_seqs=8, budget=32, max_preemptions=3, aging=1000, caching=False):
    kv = KVManager(BlockPool(num_blocks), BLOCK, enable_prefix_caching=caching)
    limits = SchedulerLimits(max_num_seqs, budget, max_preemptions, aging)
    return Scheduler(limits, kv)


def make_request(request_id, prompt_len, max_tokens=4, priority=0, first_token=10):
    prompt = list(range(first_token, first_token + prompt_len))
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    return Request(request_id, prompt, params, max_total_tokens=prompt_len + max_tokens, priority=priority)


def test_new_prompts_are_prefilled_then_decoded_one_token_per_step():
    scheduler = make_scheduler()
    scheduler.add(make_request("a", 5))
    scheduler.add(make_request("b", 3))
    assert summary(run_step(scheduler)) == [("a", 5), ("b", 3)]
    assert summary(run_step(scheduler)) == [("a", 1), ("b", 1)]


def test_long_prompt_is_prefilled_in_chunks_under_the_token_budget_and_decodes_go_first():
    scheduler = make_scheduler(budget=8)
    scheduler.add(make_request("short", 2))
    run_step(scheduler)
    scheduler.add(make_request("long", 20))
    assert summary(run_step(scheduler)) == [("short", 1), ("long", 7)]
    assert summary(run_step(scheduler)) == [("short", 1), ("long", 7)]
    assert summary(run_step(scheduler)) == [("short", 1), ("long", 6)]
    assert summary(run_step(scheduler)) == [("long", 1)]  # short finished after 4 tokens


def test_max_num_seqs_caps_the_running_set():
    scheduler = make_scheduler(max_num_seqs=2)
    for name in "abc":
        scheduler.add(make_request(name, 2))
    assert summary(run_step(scheduler)) == [("a", 2), ("b", 2)]
    assert [r.request_id for r in scheduler.waiting] == ["c"]


def test_requests_added_in_one_step_are_served_in_the_order_they_arrived_not_by_their_ids():
    # Ids compared as strings put "10" before "2": twelve prompts added at once were prefilled
    # out of order, so a batch's chunks (and FP32 prefill's roundings) changed with how many
    # requests the engine had seen before.
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=16, budget=9)
    for index in [2, 10, 1, 11, 3]:
        scheduler.add(make_request(str(index), 3))
    assert summary(run_step(scheduler)) == [("2", 3), ("10", 3), ("1", 3)]
    assert [r.request_id for r in scheduler.waiting] == ["11", "3"]
    assert [name for name, _ in summary(run_step(scheduler))] == ["2", "10", "1", "11", "3"]


def test_out_of_blocks_preempts_the_lowest_priority_latest_request():
    scheduler = make_scheduler(num_blocks=4, budget=64)
    scheduler.add(make_request("high", 4, max_tokens=8, priority=0))
    scheduler.add(make_request("low", 4, max_tokens=8, priority=5))
    scheduler.add(make_request("mid", 4, max_tokens=8, priority=1))
    run_step(scheduler)  # each holds one full block, one block free
    out = run_step(scheduler)  # high and mid need a second block: low is preempted
    assert [r.request_id for r in out.preempted] == ["low"]
    assert summary(out) == [("high", 1), ("mid", 1)]
    low = scheduler.waiting[0]
    assert (low.num_preemptions, low.num_computed_tokens, low.status) == (1, 0, RequestStatus.WAITING)
    assert scheduler.kv.block_ids("low") == []


def test_request_preempted_max_times_becomes_protected_and_reserves_its_whole_length():
    scheduler = make_scheduler(num_blocks=6, budget=64, max_preemptions=1)
    victim = make_request("victim", 4, max_tokens=12, priority=9)
    scheduler.add(make_request("a", 4, max_tokens=12))
    scheduler.add(make_request("b", 4, max_tokens=12))
    scheduler.add(victim)
    for _ in range(20):
        run_step(scheduler)
        if victim.protected:
            break
    assert victim.num_preemptions == 1 and victim.protected
    while victim.status is not RequestStatus.RUNNING:
        run_step(scheduler)
    # Admitted with blocks for its prompt and every output token, past and future: (4 + 12) / 4.
    assert len(scheduler.kv.block_ids("victim")) == 4
    while victim.status is RequestStatus.RUNNING:
        assert victim not in run_step(scheduler).preempted
    assert victim.status is RequestStatus.FINISHED_LENGTH and len(victim.output_token_ids) == 12


def test_protected_requests_are_never_chosen_as_victims():
    scheduler = make_scheduler(num_blocks=3, budget=64)
    guarded = make_request("guarded", 4, max_tokens=8, priority=9)
    guarded.protected = True
    scheduler.add(guarded)
    scheduler.add(make_request("other", 4, max_tokens=8))
    run_step(scheduler)
    for _ in range(12):
        out = run_step(scheduler)
        assert guarded not in out.preempted
    assert guarded.num_preemptions == 0


def test_waiting_request_is_not_overtaken_while_it_waits_for_memory():
    scheduler = make_scheduler(num_blocks=4, budget=64)
    scheduler.add(make_request("big", 12, max_tokens=2))
    run_step(scheduler)  # big holds 3 of 4 blocks (12 tokens) and gets a 4th for its next token
    scheduler.add(make_request("needs-two", 8, max_tokens=1))
    scheduler.add(make_request("tiny", 1, max_tokens=1, priority=5))
    out = run_step(scheduler)
    assert summary(out) == [("big", 1)]  # tiny would fit but must not overtake needs-two


def test_aging_lets_a_low_priority_request_through_a_stream_of_high_priority_ones():
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=1, budget=64, aging=2)
    scheduler.add(make_request("low", 2, max_tokens=1, priority=3))
    finished_low_at = None
    for step in range(40):
        scheduler.add(make_request(f"hi-{step}", 2, max_tokens=1, priority=0))
        out = run_step(scheduler)
        if any(s.request.request_id == "low" for s in out.scheduled):
            finished_low_at = step
            break
    assert finished_low_at is not None and finished_low_at <= 8


def test_finish_returns_every_block():
    scheduler = make_scheduler(num_blocks=8)
    scheduler.add(make_request("a", 9, max_tokens=20))
    run_step(scheduler)
    assert scheduler.kv.pool.num_free == 5
    request = scheduler.running[0]
    scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv.pool.num_free == 8 and scheduler.num_unfinished == 0


def test_prefix_cache_hit_skips_the_cached_blocks_of_a_repeated_prompt():
    scheduler = make_scheduler(caching=True)
    scheduler.add(make_request("first", 10, max_tokens=1))
    run_step(scheduler)  # finishes, its two full blocks stay cached
    scheduler.add(make_request("second", 10, max_tokens=1))
    out = run_step(scheduler)
    assert summary(out) == [("second", 2)]
    assert out.scheduled[0].request.num_cached_prompt_tokens == 8

"""Speculative decoding's parts: the n-gram proposer, the draft budget, and verification, whose
sampling keeps the target distribution exactly (chi-square over many seeded draws)."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kunlun_runtime.config import SpeculativeConfig, parse_speculative_config
from kunlun_runtime.engine.draft_price import MIN_ROWS, PRICE_STEPS, STEADY_STEPS
from kunlun_runtime.engine.request import Request
from kunlun_runtime.engine.sampling_params import SamplingParams
from kunlun_runtime.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from kunlun_runtime.engine.spec_decode import REFUSAL_STEPS, SpecDecodeCounters, SpeculativeDecoder
from kunlun_runtime.engine.spec_propose import (
    DraftBudget,
    NgramIndex,
    Proposer,
    draft_rows_worth_running,
    propose_ngram,
)
from kunlun_runtime.engine.spec_verify import verify
from kunlun_runtime.engine.step_cost import StepCostModel, StepFeatures, chunk_features, draft_row_features
from kunlun_runtime.errors import ConfigError

# The 0.1 % critical values of chi-square for 5 and 4 degrees of freedom.
CHI2_CRITICAL = {5: 20.52, 4: 18.47}


@pytest.mark.parametrize(
    ("tokens", "k", "expected", "match"),
    [
        ([1, 2, 3, 9, 1, 2, 3], 3, [9, 1, 2], 3),  # the 3-gram [1, 2, 3] seen before: what followed
        ([5, 1, 2, 7, 8, 1, 2], 2, [7, 8], 2),
        ([1, 2, 1, 3, 1, 2], 4, [1, 3, 1, 2], 2),  # the longest match wins over a shorter one
        ([1, 2, 5, 6, 1, 2, 7, 8, 1, 2], 2, [5, 6], 2),  # the first occurrence: what the source says
        ([4, 4, 4, 4], 2, [4], 3),  # after the first [4, 4, 4] only one token follows
        ([1, 2, 3, 4], 3, [], 0),  # nothing repeats
        ([7], 3, [], 0),
    ],
)
def test_ngram_proposer(tokens, k, expected, match):
    draft = propose_ngram(tokens, k, min_n=1, max_n=3)
    assert (list(draft.token_ids), draft.match_length) == (expected, match)


def test_ngram_proposer_honours_the_minimum_length():
    assert propose_ngram([1, 2, 3, 9, 5, 3], 2, min_n=2, max_n=3).token_ids == ()  # only a 1-gram repeats
    assert propose_ngram([1, 2, 3, 9, 5, 3], 2, min_n=1, max_n=3).token_ids == (9, 5)


def test_the_draft_budget_follows_acceptance_and_rests_when_nothing_is_accepted():
    budget = DraftBudget(4)
    assert budget.next() == 4
    budget.update(4, 0)
    budget.update(2, 0)
    assert budget.next() == 1
    budget.update(1, 0)  # at none: resting
    assert [budget.next() for _ in range(DraftBudget.REST_STEPS)] == [0] * (DraftBudget.REST_STEPS - 1) + [1]
    budget.update(1, 1)  # the probe held: a copy resumed, the whole budget again
    assert budget.next() == 4
    budget.update(4, 3)  # some held: the budget stays
    assert budget.next() == 4
    budget.update(4, 0)
    budget.update(0, 0)  # nothing proposed: nothing learnt
    assert budget.next() == 2
    budget.update(2, 1)
    assert budget.next() == 2
    budget.update(2, 2)
    assert budget.next() == 4


def test_a_woken_budget_probes_with_one_draft_and_follows_acceptance_from_there():
    budget = DraftBudget(4)
    for proposed in (4, 2, 1):
        budget.update(proposed, 0)
    assert [budget.next() for _ in range(3)] == [0, 0, 0]  # resting
    assert budget.wake() == 1
    budget.update(1, 1)
    assert budget.next() == 4
    assert DraftBudget(4).wake() == 4  # a budget that is not resting keeps its drafts


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_a_resting_request_drafts_again_once_it_matches_enough_tokens(method):
    # A rewrite leaves the copied text for an edit: its drafts fail and it rests. Once its last
    # WAKE_MATCH tokens occurred earlier (it copies again) it drafts at once, not after the rest;
    # a request whose tail matches nothing stays at rest.
    options = {"prompt_lookup_min": 1, "prompt_lookup_max": 4} if method == "ngram" else {}
    proposer = Proposer(SpeculativeConfig(method, num_speculative_tokens=4, **options))
    text = list(range(10, 30))
    copying = Request("copying", [*text, 99, 98], SamplingParams(temperature=0), max_total_tokens=64)
    lost = Request("lost", [*text, 99, 98], SamplingParams(temperature=0), max_total_tokens=64)
    for request in (copying, lost):
        for _ in range(3):  # 4, 2, 1 drafts, none accepted: at rest
            proposer.accepted(request.request_id, proposer.allowance(request, 10), 0)
        assert proposer.allowance(request, 10) == 0
    copying.output_token_ids.append(text[0])
    lost.output_token_ids.append(97)
    assert proposer.allowance(copying, 10) == 0  # one matched token is not yet evidence
    copying.output_token_ids.append(text[1])
    copying.output_token_ids.append(text[2])
    lost.output_token_ids.append(96)
    lost.output_token_ids.append(95)
    assert proposer.allowance(copying, 10) == 1
    assert proposer.drafts(copying, 1) == [text[3]]
    assert proposer.allowance(lost, 10) == 0


def test_counters_count_per_position():
    counters = SpecDecodeCounters()
    counters.record(3, 2)
    counters.record(4, 4)
    assert (counters.num_drafts, counters.num_draft_tokens, counters.num_accepted_tokens) == (2, 7, 6)
    assert counters.accepted_per_pos == [2, 2, 1, 1]


@pytest.mark.parametrize(
    ("value", "field", "message"),
    [
        ("{", "speculative_config", "not valid JSON"),
        ('{"method": "eagle"}', "speculative_config.method", "must be one of"),
        ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens", r"in \[1, 32\]"),
        (
            {"prompt_lookup_min": 5, "prompt_lookup_max": 2},
            "speculative_config.prompt_lookup_min",
            "<= prompt_lookup_max",
        ),
        ({"draft_model": "x"}, "speculative_config.draft_model", "unknown key"),
        ([1], "speculative_config", "must be a JSON object"),
    ],
)
def test_bad_configs_are_refused_naming_the_key(value, field, message):
    with pytest.raises(ConfigError, match=message) as error:
        parse_speculative_config(value)
    assert error.value.field == field


def test_a_good_config_parses():
    config = parse_speculative_config(
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}'
    )
    assert config == SpeculativeConfig("ngram", 5, 3, 1)


def _request(params):
    return Request("r", [1, 2, 3], params, max_total_tokens=64)


LOGITS = torch.tensor(
    [
        [2.0, 1.0, 0.5, 0.0, -1.0, 0.3],  # after the last real token
        [0.0, 1.5, 1.0, 0.2, 0.1, -0.5],  # after draft 0
        [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],  # after draft 1
    ]
)


def test_greedy_verification_accepts_while_the_model_agrees():
    request = _request(SamplingParams(temperature=0))
    generator = torch.Generator().manual_seed(0)
    emitted, accepted = verify(LOGITS, request, [0, 1], [], generator)
    assert accepted == 2 and [t for t, _ in emitted] == [0, 1, 0]  # both drafts, then the bonus
    emitted, accepted = verify(LOGITS, request, [0, 2], [], generator)
    assert accepted == 1 and [t for t, _ in emitted] == [0, 1]  # the second replaced by the model's
    emitted, accepted = verify(LOGITS, request, [3, 1], [], generator)
    assert accepted == 0 and [t for t, _ in emitted] == [0]
    assert request.output_token_ids == []  # restored


def _chi_square(counts, probs, draws):
    expected = probs * draws
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("draft", [0, 2, 4])  # a likely draft, a middling one, a rare one
def test_sampled_verification_keeps_the_target_distribution(draft):
    """The first emitted token follows p0 exactly whatever the draft; and, when the draft was
    accepted, the next one follows p1 (the distribution after the draft)."""
    params = SamplingParams(temperature=1.0)
    request = _request(params)
    p0 = torch.softmax(LOGITS[0].double(), -1)
    p1 = torch.softmax(LOGITS[1].double(), -1)
    draws = 20_000
    first = torch.zeros(6, dtype=torch.float64)
    second = torch.zeros(6, dtype=torch.float64)
    for seed in range(draws):
        emitted, accepted = verify(LOGITS[:2], request, [draft], [], torch.Generator().manual_seed(seed))
        first[emitted[0][0]] += 1
        if accepted:
            second[emitted[1][0]] += 1
    assert _chi_square(first, p0, draws) < CHI2_CRITICAL[5]
    assert second.sum() > 0.8 * p0[draft] * draws  # accepted about p0(draft) of the time
    assert _chi_square(second, p1, second.sum()) < CHI2_CRITICAL[5]


def test_penalties_see_the_accepted_drafts():
    """A frequency penalty at position 1 counts draft 0 as already output: there the model's
    choice changes, as it would when decoding token by token."""
    request = _request(SamplingParams(temperature=0, frequency_penalty=2.0))
    logits = torch.tensor([[3.0, 0.0, 0.0], [3.0, 2.0, 0.0]])
    emitted, accepted = verify(logits, request, [0], [], torch.Generator())
    assert accepted == 1 and [t for t, _ in emitted] == [0, 1]  # 3 - 2 < 2 after token 0 once


def _decoding(count, length=200):
    requests = []
    for index in range(count):
        request = Request(
            f"r{index}", list(range(3, length)), SamplingParams(temperature=0), max_total_tokens=length + 50
        )
        request.num_computed_tokens = request.num_tokens - 1
        requests.append(request)
    return requests


def _cpu_like_cost(pass_rows=None, pass_seconds=0.0, draft_seconds=0.0004):
    """A step-time model fed decode steps timed as a CPU times them: a fixed cost plus a price
    per decode row, a smaller one per draft row (its keys are read with its decode row's), and
    (with ``pass_rows``) a further read of the weights per pass of that many rows."""
    cost = StepCostModel(pass_rows=pass_rows)
    for _ in range(4):
        cost.observe(chunk_features(199, 1), 0.009)
    assert not cost.knows_decode_rows()

    def observe(rows, drafts):
        features = chunk_features(199, 1)
        for _ in range(rows - 1):
            features = features + chunk_features(199, 1)
        for _ in range(drafts):
            features = features + draft_row_features(200)
        passes = -(-(rows + drafts) // pass_rows) - 1 if pass_rows else 0
        cost.observe(features, 0.0075 + 0.00115 * rows + draft_seconds * drafts + pass_seconds * passes)

    for rows, drafts in [
        (2, 0),
        (4, 0),
        (8, 0),
        (9, 0),
        (12, 0),
        (16, 0),
        (1, 1),
        (1, 3),
        (1, 5),
        (8, 2),
        (8, 8),
    ]:
        for _ in range(4):
            observe(rows, drafts)
    return cost


def test_the_step_runs_as_many_drafts_as_raise_its_tokens_per_second():
    cost = StepCostModel()
    cost.observe(chunk_features(199, 1), 0.009)
    assert draft_rows_worth_running(cost, _decoding(1), [0.1] * 5) == 5  # no price per row known yet
    cost = _cpu_like_cost()
    # Batch 1: a draft row costs 0.4 ms beside an 8.65 ms token; the fifth draft (0.1) would lower
    # the expected tokens per second. Batch 8: beside a 16.7 ms step of 8 tokens, all four; two
    # unlikely ones would gain under the 5 % margin.
    assert draft_rows_worth_running(cost, _decoding(1), [0.9, 0.8, 0.6, 0.3, 0.1, 0.05]) == 4
    assert draft_rows_worth_running(cost, _decoding(8), [0.9, 0.8, 0.6, 0.3]) == 4
    assert draft_rows_worth_running(cost, _decoding(8), [0.4, 0.3]) == 0


def test_a_draft_row_is_priced_as_measured_not_as_a_decode_row():
    # The same decode steps with draft rows at 2 ms each (a row that reads its own 1,500 keys): at
    # batch 8 the same four drafts would lower the step's tokens per second; at 0.4 ms they raise it.
    assert (
        draft_rows_worth_running(_cpu_like_cost(draft_seconds=0.002), _decoding(8), [0.9, 0.8, 0.6, 0.3]) == 0
    )
    assert draft_rows_worth_running(_cpu_like_cost(), _decoding(8), [0.9, 0.8, 0.6, 0.3]) == 4


def test_adjacent_steps_of_the_same_requests_price_drafts_over_the_step_time_model():
    # The model was fed draft rows at 2 ms (it refuses four drafts at batch 8); the engine's own
    # steps of these requests say 0.4 ms beside a 16.7 ms step: the measured series decides.
    misled = _cpu_like_cost(draft_seconds=0.002)
    measured = [0.0167 + 0.0004 * i for i in range(9)]
    assert draft_rows_worth_running(misled, _decoding(8), [0.9, 0.8, 0.6, 0.3]) == 0
    assert draft_rows_worth_running(misled, _decoding(8), [0.9, 0.8, 0.6, 0.3], measured) == 4
    assert draft_rows_worth_running(_cpu_like_cost(), _decoding(8), [0.9, 0.8], [0.0167, 0.03, 0.05]) == 0


def test_the_decoder_prices_drafts_from_its_pure_decode_steps_only():
    decoder = SpeculativeDecoder(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=2), [0])
    requests = _decoding(2)
    batch = frozenset(r.request_id for r in requests)

    def step(drafts, prefill=0):
        scheduled = [ScheduledRequest(r, 1 + drafts, drafts) for r in requests]
        features = StepFeatures(prefill, len(requests), 0, drafts * len(requests))
        return SchedulerOutput(scheduled, features=features)

    decoder.observe(step(0), 0.020)
    decoder.observe(step(4, prefill=64), 0.500)  # a prompt chunk beside the drafts: not a pair
    decoder.observe(step(0, prefill=64), 0.400)  # nor a plain decode step
    decoder.observe(step(4), 0.028)  # 8 draft rows, 1 ms each
    assert [round(t * 1e3, 6) for t in decoder.price.series(batch, 2)] == [20.0, 21.0, 22.0]


def _copying(count):
    """``count`` requests decoding a repeated pattern: every step's n-gram drafts match."""
    requests = []
    for index in range(count):
        request = Request(f"r{index}", [5, 6, 7, 8] * 50, SamplingParams(temperature=0), max_total_tokens=260)
        request.num_computed_tokens = request.num_tokens - 1
        requests.append(request)
    return requests


def test_a_refusal_to_draft_stands_a_few_steps_unless_the_requests_change():
    # Drafts priced above what they bring are refused; the refusal stands for REFUSAL_STEPS steps
    # of the same requests (their chances cannot change without a verification) even where the
    # step-time model now finds drafts cheap; after them, or with another set of requests, the
    # step decides again.
    decoder = SpeculativeDecoder(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3), [0])
    requests = _copying(8)
    costly, cheap = _cpu_like_cost(draft_seconds=0.01), _cpu_like_cost()

    def drafted(batch, cost):
        decoder.propose(batch, 16, cost, lambda _: None)
        return sum(len(request.spec_token_ids) for request in batch)

    assert drafted(requests, costly) == 0
    assert [drafted(requests, cheap) for _ in range(REFUSAL_STEPS - 1)] == [0] * (REFUSAL_STEPS - 1)
    assert drafted(requests, cheap) > 0
    assert drafted(requests, costly) == 0
    assert drafted(requests[:7], cheap) > 0


def test_a_batch_drafting_as_many_rows_each_step_unpriced_runs_one_fewer_once():
    # Eight requests copying a repeated pattern: every step runs the 8 drafts the rows allow, so
    # no step of theirs prices a draft row. After STEADY_STEPS such steps one runs half of them
    # (the likelier); the step down and the step back up price the row (twice 4 rows: MIN_ROWS),
    # and the batch drafts fully again.
    decoder = SpeculativeDecoder(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3), [0])
    requests = _copying(8)
    batch = frozenset(request.request_id for request in requests)
    cost = _cpu_like_cost()

    def drafted():
        decoder.propose(requests, 16, cost, lambda _: None)
        rows = sum(len(request.spec_token_ids) for request in requests)
        decoder.price.observe(batch, rows, 0.030 + 0.001 * rows)
        return rows

    assert MIN_ROWS <= 8
    assert [drafted() for _ in range(STEADY_STEPS + 3)] == [8] * STEADY_STEPS + [4, 8, 8]
    assert [round(t * 1e3, 6) for t in decoder.price.series(batch, 1)] == [30.0, 31.0]


def test_drafting_resumes_after_a_busy_spell_priced_its_rows_too_high():
    # Eight requests copying a repeated pattern, their steps timed at 30 ms plus 1 ms a draft row,
    # until a busy spell makes two steps with drafts 60 ms slower: those pairs price a row so high
    # that the drafts are refused, and no step drafts to outvote them. Once the pairs expire the
    # drafts run again and are priced at what they cost.
    decoder = SpeculativeDecoder(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3), [0])
    requests = _copying(8)
    batch = frozenset(request.request_id for request in requests)
    cost = _cpu_like_cost()
    decoder.price.observe(batch, 0, 0.030)

    def drafted(busy=0.0):
        decoder.propose(requests, 16, cost, lambda _: None)
        rows = sum(len(request.spec_token_ids) for request in requests)
        decoder.price.observe(batch, rows, 0.030 + 0.001 * rows + (busy if rows else 0.0))
        return rows

    assert drafted() == 8
    assert [drafted(busy=0.060) for _ in range(2)] == [8, 8]
    assert decoder.price.series(batch, 1)[1] > 0.030 + 0.005  # a row priced above 5 ms
    refused = [drafted() for _ in range(PRICE_STEPS - 3)]
    assert refused == [0] * len(refused)
    assert [drafted() for _ in range(REFUSAL_STEPS)][-1] == 8  # the refusal's last stand, then drafts
    assert [round(t * 1e3, 6) for t in decoder.price.series(batch, 1)] == [30.0, 31.0]


def test_a_new_pass_over_the_weights_is_paid_for_by_the_drafts_after_it():
    # 8 rows per read of the weights, 3 ms a further read: at batch 8 the first draft row starts
    # a second pass. One likely draft cannot pay for it; eight nearly certain ones can; at 12 ms a
    # pass they would gain too little to be worth the risk.
    cost = _cpu_like_cost(pass_rows=8, pass_seconds=0.003)
    assert draft_rows_worth_running(cost, _decoding(8), [0.95]) == 0
    assert draft_rows_worth_running(cost, _decoding(8), [0.95] * 8) == 8
    costly = _cpu_like_cost(pass_rows=8, pass_seconds=0.012)
    assert draft_rows_worth_running(costly, _decoding(8), [0.95] * 8) == 0
    assert draft_rows_worth_running(cost, _decoding(4), [0.95, 0.9, 0.1, 0.1, 0.1]) == 2  # within the pass


def test_a_request_proposes_its_budget_and_its_drafts_chances_fall_with_position():
    proposer = Proposer(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=2))
    request = Request("r", [1, 2, 3, 4, 5, 6, 1, 2], SamplingParams(temperature=0), max_total_tokens=64)
    assert proposer.propose(request, room=10) == [3, 4, 5, 6]
    assert proposer.propose(request, room=2) == [3, 4]  # never beyond its room
    assert [round(proposer.chance("r", j), 3) for j in range(3)] == [0.6, 0.36, 0.216]
    proposer.accepted("r", 4, 4)
    assert proposer.chance("r", 0) > 0.8  # 4 more of 4 tested: from 2.4 of 4 to 5.92 of 7.2
    assert proposer.chance("r", 1) == pytest.approx(proposer.chance("r", 0) ** 2)


@pytest.mark.parametrize("rate", [0.3, 0.6, 0.85])
def test_the_chances_match_the_acceptance_seen_however_many_drafts_a_request_proposes(rate):
    # Each draft is accepted with `rate` while the ones before it were (a geometric run), 5 drafts
    # a step. Counting the drafts after a rejection as failures would put the first draft's
    # chance near (rate + ... + rate**5) / 5, and the expected accepted drafts well under those seen.
    proposer = Proposer(SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_max=2))
    draws = random.Random(7)
    expected = seen = 0.0
    for step in range(400):
        chances = [proposer.chance("r", position) for position in range(5)]
        accepted = 0
        while accepted < 5 and draws.random() < rate:
            accepted += 1
        if step >= 50:  # past the prior
            expected += sum(chances)
            seen += accepted
        proposer.accepted("r", 5, accepted)
    assert expected == pytest.approx(seen, rel=0.15)


def test_a_new_request_starts_from_the_acceptance_across_requests():
    # Drafts that keep failing for others (free text) lower where a new request starts.
    proposer = Proposer(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=2))
    assert proposer.chance("new", 0) == pytest.approx(0.6)
    for index in range(40):
        proposer.accepted(f"old-{index}", 4, 0)
    assert proposer.chance("new", 0) < 0.1
    proposer.accepted("new", 2, 2)  # its own verifications move it from there
    assert 0.1 < proposer.chance("new", 0) < 0.6


def test_a_suffix_draft_from_a_match_length_whose_drafts_fail_is_priced_lower():
    # Across requests, drafts after a 3-token match were all accepted and those after a 1-token
    # match none: a new request's draft from a 1-token match gets little more than half the chance of one
    # from a 3-token match (its own acceptance, lowered halfway to its match length's), and the
    # chance hoped for before proposing is never below the one a proposal gets.
    proposer = Proposer(
        SpeculativeConfig(method="suffix", num_speculative_tokens=2, suffix_decoding_max_cached_requests=0)
    )
    long_match = [1, 2, 3, 4, 5, 1, 2, 3]  # [1, 2, 3] seen before: drafts [4, 5]
    short_match = [1, 6, 7, 8, 9, 1]  # only [1]: drafts [6, 7]
    for index in range(20):
        for tokens, accepted in ((long_match, 2), (short_match, 0)):
            request = Request(
                f"old-{index}-{accepted}", tokens, SamplingParams(temperature=0), max_total_tokens=64
            )
            assert proposer.drafts(request, 2)
            proposer.accepted(request.request_id, 2, accepted)
    fresh = {
        name: Request(name, tokens, SamplingParams(temperature=0), max_total_tokens=64)
        for name, tokens in (("long", long_match), ("short", short_match))
    }
    hoped = {name: proposer.best_chance(name, 0) for name in fresh}
    for request in fresh.values():
        proposer.drafts(request, 2)
    assert proposer.chance("long", 0) == pytest.approx(hoped["long"])
    assert proposer.chance("short", 0) < 0.6 * proposer.chance("long", 0)
    assert all(hoped[name] >= proposer.chance(name, 0) for name in fresh)


def test_a_copied_draft_that_continues_its_requests_copy_is_priced_apart_from_a_new_match():
    # Across requests, copied drafts that came from a new match all failed and those that went on
    # copying from as far behind the request's end as its drafts before them all held: a request's
    # next draft that goes on copying keeps its own chance, one from a new match is lowered towards
    # the failures; the chance hoped for before proposing is never below the one a proposal gets.
    proposer = Proposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=2))
    text = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]

    def copying(name: str, copied: int) -> Request:  # the text, then its first `copied` tokens again
        return Request(name, text + text[:copied], SamplingParams(temperature=0), max_total_tokens=64)

    for index in range(20):
        request = copying(f"old-{index}", 2)
        assert proposer.drafts(request, 3) == [12, 13, 14]  # a new match: the copy starts
        proposer.accepted(request.request_id, 3, 0)
        request.output_token_ids = text[2:5]  # it copied on regardless, 3 tokens later
        assert proposer.drafts(request, 3) == [15, 16, 17]  # the same distance back: continues
        proposer.accepted(request.request_id, 3, 3)
    going_on, jumping = copying("going-on", 2), copying("jumping", 2)
    for request in (going_on, jumping):
        proposer.drafts(request, 3)
    going_on.output_token_ids = text[2:6]
    jumping.output_token_ids = [12, 13, 17, 18]  # skipped to a later sentence: copies from elsewhere
    hoped = {name: proposer.best_chance(name, 0) for name in ("going-on", "jumping")}
    assert proposer.drafts(going_on, 3) == [16, 17, 18]
    assert proposer.drafts(jumping, 3) == [19, 20, 21]
    assert proposer.chance("going-on", 0) == pytest.approx(hoped["going-on"])
    assert proposer.chance("jumping", 0) < 0.75 * proposer.chance("going-on", 0)
    assert all(hoped[name] >= proposer.chance(name, 0) for name in hoped)


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), min_size=1, max_size=60),
    cuts=st.lists(st.integers(1, 60), max_size=6),
    bounds=st.tuples(st.integers(1, 4), st.integers(0, 4)),
    k=st.integers(1, 6),
)
def test_the_ngram_index_proposes_what_the_scan_proposes_as_tokens_grow(tokens, cuts, bounds, k):
    min_n, extra = bounds
    index = NgramIndex(min_n, min_n + extra)
    for length in sorted({*cuts, len(tokens)}):
        prefix = tokens[: min(length, len(tokens))]
        assert index.propose(prefix, k) == propose_ngram(prefix, k, min_n, min_n + extra)  # and its match

"""Suffix decoding across requests: the cache of finished outputs stays within its bound and holds
exactly the newest outputs' counts; a request's draft is the better of its own tree's and its
tenant's, and never comes from another tenant's text; the proposer wires it by method."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kunlun_runtime.config import SpeculativeConfig
from kunlun_runtime.engine.request import Request
from kunlun_runtime.engine.sampling_params import SamplingParams
from kunlun_runtime.engine.spec_propose import Proposer
from kunlun_runtime.engine.suffix_cache import SuffixCache, SuffixIndex, SuffixParams
from kunlun_runtime.lora.request import LoRARequest
from tests.support.suffix_reference import path_counts, reference_draft, substring_counts

TENANTS = [(None, None), ("salt-b", None), (None, (1, "adapter"))]
streams = st.lists(st.integers(0, 3), min_size=1, max_size=30)


@settings(max_examples=150, deadline=None)
@given(
    outputs=st.lists(st.tuples(st.integers(0, 2), streams), min_size=1, max_size=12),
    max_cached_requests=st.integers(1, 4),
)
def test_the_cache_holds_exactly_the_newest_outputs_of_each_tenant(outputs, max_cached_requests):
    cache = SuffixCache(max_tree_depth=5, max_cached_requests=max_cached_requests)
    for count, (tenant, output) in enumerate(outputs, start=1):
        cache.add(TENANTS[tenant], output)
        kept = outputs[max(0, count - max_cached_requests) : count]
        assert cache.num_requests == len(kept)
        for index, key in enumerate(TENANTS):
            mine = [tokens for owner, tokens in kept if owner == index]
            tree = cache.tree(key)
            if not mine:
                assert tree is None  # a tenant's tree goes with its last output
            else:
                assert tree is not None and path_counts(tree) == substring_counts(mine, 5)
                assert tree.num_nodes <= 1 + sum(len(tokens) * 5 for tokens in mine)


def test_cycling_outputs_through_the_cache_does_not_grow_it():
    """Evicted outputs leave nothing behind: the same outputs again give the same tree."""
    rng = random.Random(0)
    cycle = [[rng.randrange(20) for _ in range(40)] for _ in range(12)]
    cache = SuffixCache(max_tree_depth=8, max_cached_requests=5)
    sizes = []
    for _ in range(3):
        for output in cycle:
            cache.add(TENANTS[0], output)
        sizes.append(cache.num_nodes)
    assert sizes[0] == sizes[1] == sizes[2] < 1 + 5 * 40 * 8 and cache.num_requests == 5


def test_a_cache_of_no_requests_or_an_empty_output_keeps_nothing():
    none = SuffixCache(max_tree_depth=8, max_cached_requests=0)
    none.add(TENANTS[0], [1, 2, 3])
    some = SuffixCache(max_tree_depth=8, max_cached_requests=3)
    some.add(TENANTS[0], [])
    assert (none.num_requests, none.tree(TENANTS[0]), some.num_requests) == (0, None, 0)


def _best(own, shared):
    return own[0] if own[1] >= shared[1] else shared[0]


@settings(max_examples=200, deadline=None)
@given(
    outputs=st.lists(st.tuples(st.integers(0, 2), streams), max_size=6),
    tenant=st.integers(0, 2),
    tokens=streams,
    cut=st.integers(1, 30),
    k=st.integers(1, 8),
)
def test_a_request_gets_the_better_draft_of_its_own_tokens_and_its_tenants_outputs(
    outputs, tenant, tokens, cut, k
):
    """Exactly the better of the scans of its own tokens and of its own tenant's outputs: the
    other tenants' outputs could only have changed it, never do."""
    params = SuffixParams(max_tree_depth=6, max_cached_requests=100, max_spec_factor=1.0, min_token_prob=0.1)
    cache = SuffixCache(params.max_tree_depth, params.max_cached_requests)
    for owner, output in outputs:
        cache.add(TENANTS[owner], output)
    index = SuffixIndex(params, cache, TENANTS[tenant])
    mine = [output for owner, output in outputs if owner == tenant]
    for prefix in (tokens[: min(cut, len(tokens))], tokens):  # as the request grows
        own = reference_draft([prefix], prefix, 6, k, 1.0, 0.1)
        shared = reference_draft(mine, prefix, 6, k, 1.0, 0.1)
        assert index.propose(prefix, k).token_ids == _best(own, shared)


def test_one_tenants_text_is_never_proposed_to_another():
    params = SuffixParams(max_tree_depth=8)
    cache = SuffixCache(params.max_tree_depth, params.max_cached_requests)
    cache.add(TENANTS[1], [40, 41, 42, 43, 44, 45])
    context = [9, 40, 41, 42]
    assert SuffixIndex(params, cache, TENANTS[1]).propose(context, 8).token_ids == (43, 44, 45)
    assert SuffixIndex(params, cache, TENANTS[0]).propose(context, 8).token_ids == ()
    assert SuffixIndex(params, cache, ("salt-b", (1, "adapter"))).propose(context, 8).token_ids == ()


def _request(request_id, prompt, output=(), cache_salt=None, lora=None):
    request = Request(
        request_id, list(prompt), SamplingParams(temperature=0), 256, cache_salt=cache_salt, lora=lora
    )
    request.output_token_ids.extend(output)
    return request


def test_the_suffix_proposer_caches_a_finished_output_for_its_tenant_only():
    proposer = Proposer(SpeculativeConfig(method="suffix", suffix_decoding_max_tree_depth=16))
    assert proposer.config.num_speculative_tokens == 24  # suffix's default
    first = _request("a", [1, 2, 3], output=[50, 51, 52, 53, 54, 55, 56], cache_salt="t1")
    assert proposer.propose(first, room=10) == []  # nothing repeats yet
    proposer.forget(first)
    same = _request("b", [7, 50, 51, 52], cache_salt="t1")
    assert proposer.propose(same, room=10) == [53, 54, 55]  # three matched: three drafts
    assert proposer.propose(_request("c", [7, 50, 51, 52], cache_salt="t2"), room=10) == []
    adapter = LoRARequest("sql", 1, "/adapters/sql")
    assert proposer.propose(_request("d", [7, 50, 51, 52], cache_salt="t1", lora=adapter), room=10) == []


def test_the_ngram_proposer_caches_nothing_across_requests():
    proposer = Proposer(SpeculativeConfig(method="ngram"))
    proposer.forget(_request("a", [1, 2, 3], output=[50, 51, 52, 53]))
    assert proposer.propose(_request("b", [7, 50, 51]), room=10) == []

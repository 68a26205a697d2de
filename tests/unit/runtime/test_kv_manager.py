"""The KV manager, block id by block id: prefix hits come back as ``CachedPrefix`` (ids, never the
pool's blocks), allocation shares them, lookups that are not queries leave the hit counters alone."""

from dataclasses import dataclass

from kunlun_runtime.kv.block_pool import BlockPool
from kunlun_runtime.kv.kv_manager import NO_CACHED_PREFIX, CachedPrefix, KVManager

BLOCK = 4


@dataclass
class FakeRequest:
    """Only what ``KVRequest`` asks for: the KV layer never sees the engine's Request."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    lora_key: tuple[int, str] | None = None
    wants_prompt_logprobs: bool = False


def make_manager(num_blocks=8, caching=True):
    return KVManager(BlockPool(num_blocks), BLOCK, enable_prefix_caching=caching)


def prefill(kv: KVManager, request: FakeRequest) -> None:
    """Allocate and compute the whole prompt, then register its full blocks (as a step would)."""
    assert kv.allocate(request, len(request.all_token_ids))
    request.num_computed_tokens = len(request.all_token_ids)
    kv.cache_computed_blocks(request)


def test_a_second_request_with_the_same_prefix_gets_the_first_ones_block_ids():
    kv = make_manager()
    first = FakeRequest("a", list(range(10)))  # blocks [0..3] [4..7] full, [8, 9] partial
    prefill(kv, first)
    second = FakeRequest("b", [*range(8), 42, 43, 44])
    hit = kv.find_cached_prefix(second)
    assert hit == CachedPrefix(tuple(kv.block_ids("a")[:2]), num_tokens=8)
    assert hit.num_blocks == 2
    assert kv.allocate(second, 3, hit)
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]  # shared, not copied
    assert len(kv.block_ids("b")) == 3
    assert (kv.num_prefix_queries, kv.num_prefix_hits) == (11, 8)


def test_the_last_token_is_never_a_hit_so_the_step_has_logits_for_it():
    kv = make_manager()
    prefill(kv, FakeRequest("a", list(range(8))))
    assert kv.find_cached_prefix(FakeRequest("b", list(range(8)))).num_blocks == 1


def test_no_hit_without_caching_with_prompt_logprobs_or_under_another_salt():
    for kv, request in [
        (make_manager(caching=False), FakeRequest("b", list(range(9)))),
        (make_manager(), FakeRequest("b", list(range(9)), wants_prompt_logprobs=True)),
        (make_manager(), FakeRequest("b", list(range(9)), cache_salt="tenant-2")),
    ]:
        prefill(kv, FakeRequest("a", list(range(9))))
        assert kv.find_cached_prefix(request) == NO_CACHED_PREFIX


def test_counting_resident_blocks_is_not_a_cache_query():
    kv = make_manager()
    prefill(kv, FakeRequest("a", list(range(9))))
    probe = FakeRequest("b", [*range(4), 99, 99, 99, 99, 99])
    assert kv.num_cached_blocks(kv.prefix_hashes(probe)) == 1
    assert (kv.num_prefix_queries, kv.num_prefix_hits) == (0, 0)


def test_a_failed_allocation_changes_nothing_and_free_returns_every_block():
    kv = make_manager(num_blocks=4)
    prefill(kv, FakeRequest("a", list(range(9))))  # 3 blocks
    kv.free(FakeRequest("a", []))
    big = FakeRequest("b", list(range(30)))
    hit = kv.find_cached_prefix(big)
    assert hit.num_blocks == 2
    assert not kv.allocate(big, 22, hit)  # 2 cached + 6 new > 4 blocks
    assert not kv.holds("b") and kv.pool.num_free == 4
    assert kv.allocate(big, 6, hit)  # 2 cached + 2 new: the cached ones revive
    assert kv.pool.num_free == 0
    kv.free(big)
    assert kv.pool.num_free == 4

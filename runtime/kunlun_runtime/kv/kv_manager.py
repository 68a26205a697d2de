"""Per-request block tables on top of the block pool, with prefix reuse.

The manager answers three questions for the scheduler: which cached blocks a request's prefix
can reuse, whether its next tokens fit (allocating if so), and when to return its blocks. It
never holds a block for a request it was not asked about, so ``free`` returns every block.
The pool's ``Block`` objects never leave this module: callers see block ids and ``CachedPrefix``.
It reads requests through ``KVRequest``, so the KV layer does not depend on the engine above it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kunlun_runtime.kv.block_pool import Block, BlockPool
from kunlun_runtime.kv.prefix_hash import DEFAULT_HASHER, PrefixHasher


class KVRequest(Protocol):
    """What the manager reads of a request (the engine's ``Request`` satisfies it)."""

    @property
    def request_id(self) -> str: ...
    @property
    def cache_salt(self) -> str | None: ...
    @property
    def lora_key(self) -> tuple[int, str] | None: ...  # the adapter's (id, name); None: the base model
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def all_token_ids(self) -> list[int]: ...
    @property
    def wants_prompt_logprobs(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    """A request's leading full blocks found in the prefix cache, to pass back to ``allocate``.

    Valid until the next call that allocates or frees: the blocks are not referenced yet.
    """

    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0  # the tokens those blocks hold: their number times the block size

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


NO_CACHED_PREFIX = CachedPrefix()


class KVManager:
    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        enable_prefix_caching: bool,
        hasher: PrefixHasher = DEFAULT_HASHER,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hasher = hasher
        self._blocks: dict[str, list[Block]] = {}
        self._hashes: dict[str, list[int]] = {}
        self.num_prefix_queries = 0  # tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # tokens found there

    def prefix_hashes(self, request: KVRequest) -> list[int]:
        """Hashes of the request's leading full blocks that a prefix hit may cover (its last token
        is always computed, so that the step produces logits for it); empty when it may not reuse."""
        if not self.enable_prefix_caching or request.wants_prompt_logprobs:
            return []
        tokens = request.all_token_ids
        return self.hasher.hash_full_blocks(
            tokens[: len(tokens) - 1], self.block_size, request.cache_salt, lora=request.lora_key
        )

    def num_cached_blocks(self, block_hashes: Sequence[int]) -> int:
        """How many of ``block_hashes``, from the first, are in the prefix cache now."""
        return len(self._lookup(block_hashes))

    def find_cached_prefix(self, request: KVRequest) -> CachedPrefix:
        """The cached blocks matching the request's leading full blocks (counted as a cache query)."""
        if not self.enable_prefix_caching or request.wants_prompt_logprobs:
            return NO_CACHED_PREFIX
        hits = self._lookup(self.prefix_hashes(request))
        self.num_prefix_queries += len(request.all_token_ids)
        self.num_prefix_hits += len(hits) * self.block_size
        return CachedPrefix(tuple(block.block_id for block in hits), len(hits) * self.block_size)

    def _lookup(self, block_hashes: Sequence[int]) -> list[Block]:
        hits: list[Block] = []
        for block_hash in block_hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate(
        self,
        request: KVRequest,
        num_new_tokens: int,
        cached_prefix: CachedPrefix = NO_CACHED_PREFIX,
        reserve_tokens: int = 0,
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens (plus ``reserve_tokens`` held for later)
        after the request's computed ones and the ``cached_prefix`` blocks. Returns False, changing
        nothing, when the pool cannot provide them."""
        cached = [self.pool.blocks[block_id] for block_id in cached_prefix.block_ids]
        blocks = self._blocks.get(request.request_id, [])
        total_tokens = (
            request.num_computed_tokens + len(cached) * self.block_size + num_new_tokens + reserve_tokens
        )
        num_needed = max(0, -(-total_tokens // self.block_size) - len(blocks) - len(cached))
        num_reviving = sum(1 for block in cached if block.ref_count == 0)
        if num_needed + num_reviving > self.pool.num_free:
            return False
        self.pool.touch(cached)
        self._blocks[request.request_id] = blocks + cached + self.pool.allocate(num_needed)
        return True

    def block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self._blocks.get(request_id, [])]

    def cache_computed_blocks(self, request: KVRequest) -> None:
        """Hash and register the request's blocks that are now full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        blocks = self._blocks.get(request.request_id)
        if not blocks:
            return
        num_full = request.num_computed_tokens // self.block_size
        known = self._hashes.get(request.request_id, [])
        if num_full <= len(known):
            return
        tokens = request.all_token_ids[: num_full * self.block_size]
        hashes = self.hasher.hash_full_blocks(
            tokens, self.block_size, request.cache_salt, known, lora=request.lora_key
        )
        self.pool.cache_blocks(
            blocks[len(known) : num_full],
            hashes[len(known) :],
            known[-1] if known else None,
            tokens[len(known) * self.block_size :],
            self.block_size,
            request.lora_key,
        )
        self._hashes[request.request_id] = hashes

    def release_beyond(self, request: KVRequest, num_tokens: int) -> None:
        """Return the request's blocks past the first ``num_tokens`` tokens' (tail first): the room
        a step made for drafts that were rejected. Those blocks hold no computed token, so none is
        in the prefix cache."""
        blocks = self._blocks.get(request.request_id)
        keep = -(-num_tokens // self.block_size)
        if blocks is None or len(blocks) <= keep:
            return
        self.pool.free(list(reversed(blocks[keep:])))
        del blocks[keep:]

    def free(self, request: KVRequest) -> None:
        """Return all of the request's blocks (tail first, so the shared head stays cached longest)."""
        blocks = self._blocks.pop(request.request_id, [])
        self._hashes.pop(request.request_id, None)
        self.pool.free(list(reversed(blocks)))

    def holds(self, request_id: str) -> bool:
        return request_id in self._blocks

"""The block pool: ref-counted KV blocks, a free list in LRU order, and the prefix-hash map.

Invariants: a block is either referenced (ref_count > 0, not in the free list) or free (in the
free list exactly once); a block with a hash is findable by it until it is handed out again.
Free cached blocks are evicted least-recently-used first, so a conversation's history survives
as long as memory allows. A block id is never handed out twice while referenced.

With ``record_events``, the pool keeps the KV events of what it does (kv/kv_events.py) until
``drain_events``: one hash is cached by one block at a time, so the events say exactly which
hashes are cached (stored minus removed since the last clear: ``cached_block_hashes``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kunlun_runtime.errors import KunlunRuntimeError
from kunlun_runtime.kv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kunlun_runtime.kv.prefix_hash import external_block_hash


class OutOfBlocksError(KunlunRuntimeError):
    """More blocks were asked for than are free (callers check ``num_free`` first)."""


@dataclass(eq=False, slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set once the block is full and hashed


class BlockPool:
    def __init__(self, num_blocks: int, *, record_events: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, Block] = {}
        self.num_evictions = 0
        self._events: list[KVCacheEvent] | None = [] if record_events else None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage_ratio(self) -> float:
        """Fraction of blocks referenced by live requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self, count: int) -> list[Block]:
        """Hand out ``count`` free blocks, evicting the least recently used cached ones."""
        if count > len(self._free):
            raise OutOfBlocksError(f"asked for {count} blocks, {len(self._free)} free")
        out = []
        evicted: list[int] = []
        for _ in range(count):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                evicted.append(external_block_hash(block.block_hash))
                self._uncache(block)
            block.ref_count = 1
            out.append(block)
        if evicted and self._events is not None:
            self._events.append(BlockRemoved(tuple(evicted)))
        return out

    def lookup(self, block_hash: int) -> Block | None:
        return self._cached.get(block_hash)

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on cached blocks (a prefix hit), removing free ones from the free list."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def free(self, blocks: list[Block]) -> None:
        """Drop one reference on each block; blocks reaching zero go to the end of the free list.

        Pass a request's blocks in reverse order so that its tail (least shareable) is evicted first.
        """
        for block in blocks:
            if block.ref_count <= 0:
                raise AssertionError(f"block {block.block_id} freed twice")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = block

    def cache(self, block: Block, block_hash: int) -> bool:
        """Register a full block under ``block_hash`` (first writer wins for duplicates); True if
        it entered the cache now. Records no event: ``cache_blocks`` does."""
        if block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True

    def cache_blocks(
        self,
        blocks: Sequence[Block],
        block_hashes: Sequence[int],
        parent_hash: int | None,
        token_ids: Sequence[int],
        block_size: int,
        lora: tuple[int, str] | None = None,
    ) -> None:
        """Register consecutive full blocks of one request under their hashes (the first after
        ``parent_hash``; ``token_ids`` are the blocks' tokens) and record a ``BlockStored`` for each
        run of them that entered the cache (a block whose hash another block holds does not).
        ``lora``: the (id, name) of the adapter the request runs on, which the events name."""
        run: list[int] = []
        run_parent: int | None = None
        run_start = 0
        for index, (block, block_hash) in enumerate(zip(blocks, block_hashes, strict=True)):
            if self.cache(block, block_hash):
                if not run:
                    run_parent, run_start = parent_hash, index
                run.append(block_hash)
            elif run:
                self._record_stored(run, run_parent, token_ids[run_start * block_size :], block_size, lora)
                run = []
            parent_hash = block_hash
        if run:
            self._record_stored(run, run_parent, token_ids[run_start * block_size :], block_size, lora)

    def _record_stored(
        self,
        run: list[int],
        parent: int | None,
        token_ids: Sequence[int],
        block_size: int,
        lora: tuple[int, str] | None,
    ) -> None:
        if self._events is None:
            return
        self._events.append(
            BlockStored(
                block_hashes=tuple(external_block_hash(h) for h in run),
                parent_block_hash=None if parent is None else external_block_hash(parent),
                token_ids=tuple(token_ids[: len(run) * block_size]),
                block_size=block_size,
                lora_id=None if lora is None else lora[0],
                lora_name=None if lora is None else lora[1],
            )
        )

    def _uncache(self, block: Block) -> None:
        assert block.block_hash is not None
        self.num_evictions += 1
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash = None

    def reset_prefix_cache(self) -> None:
        """Forget every hash (e.g. after weights change), blocks in use included."""
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        if self._events is not None:
            self._events.append(AllBlocksCleared())

    def drain_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last drain, oldest first (empty when not recording)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def cached_block_hashes(self) -> frozenset[int]:
        """The hashes, as KV events name them, of the blocks in the prefix cache now."""
        return frozenset(external_block_hash(block_hash) for block_hash in self._cached)

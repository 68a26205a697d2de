"""The block pool: ref-counted KV blocks, a free list in LRU order, and the prefix-hash map.

Invariants: a block is either referenced (ref_count > 0, not in the free list) or free (in the
free list exactly once); a block with a hash is findable by it until it is handed out again.
Free cached blocks are evicted least-recently-used first, so a conversation's history survives
as long as memory allows. A block id is never handed out twice while referenced.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kunlun_runtime.errors import KunlunRuntimeError


class OutOfBlocksError(KunlunRuntimeError):
    """More blocks were asked for than are free (callers check ``num_free`` first)."""


@dataclass(eq=False, slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set once the block is full and hashed


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, Block] = {}
        self.num_evictions = 0

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
        for _ in range(count):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                self._uncache(block)
            block.ref_count = 1
            out.append(block)
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

    def cache(self, block: Block, block_hash: int) -> None:
        """Register a full block under ``block_hash`` (first writer wins for duplicates)."""
        if block.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def _uncache(self, block: Block) -> None:
        assert block.block_hash is not None
        self.num_evictions += 1
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash = None

    def reset_prefix_cache(self) -> None:
        """Forget every hash (e.g. after weights change)."""
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()

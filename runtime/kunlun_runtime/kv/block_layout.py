"""Where each KV block lives in memory: aligned to the cache line and skewed across cache sets.

Aligning every block to the cache line is not enough. When the block size is a multiple of the
cache's set period (lines × sets), every block starts in the same cache set, and a long-context
decode that walks all blocks keeps evicting itself. Skewing gives each block a stride of an odd
number of cache lines, so consecutive block starts cycle through every set. This module is pure
arithmetic over byte offsets; ``kv/cache.py`` applies it to tensors.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """Byte layout of one pool of equally sized KV blocks."""

    block_bytes: int  # payload of one block (block_size × kv_heads × head_dim × dtype bytes)
    stride_bytes: int  # distance between consecutive block starts (payload + padding)
    cache_line_bytes: int
    cache_num_sets: int

    def offset_bytes(self, block_id: int) -> int:
        """Start of block ``block_id`` relative to the (aligned) pool start."""
        return block_id * self.stride_bytes

    def set_index(self, block_id: int) -> int:
        """Cache set that the first line of block ``block_id`` maps to."""
        return (self.offset_bytes(block_id) // self.cache_line_bytes) % self.cache_num_sets

    @property
    def padding_bytes(self) -> int:
        return self.stride_bytes - self.block_bytes


def build_block_layout(
    block_bytes: int, *, cache_line_bytes: int, cache_num_sets: int, skew: bool
) -> BlockLayout:
    """Lay out blocks of ``block_bytes``: the stride is a whole number of cache lines, and with
    ``skew`` an odd number of them (coprime with the power-of-two set count), so that any
    ``cache_num_sets`` consecutive blocks start in distinct sets.

    Raises ValueError for a non-power-of-two cache line or set count, or a non-positive size.
    """
    for name, value in (("cache_line_bytes", cache_line_bytes), ("cache_num_sets", cache_num_sets)):
        if value <= 0 or value & (value - 1):
            raise ValueError(f"{name} must be a positive power of two, got {value}")
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    lines = -(-block_bytes // cache_line_bytes)
    if skew and lines % 2 == 0:
        lines += 1
    return BlockLayout(
        block_bytes=block_bytes,
        stride_bytes=lines * cache_line_bytes,
        cache_line_bytes=cache_line_bytes,
        cache_num_sets=cache_num_sets,
    )

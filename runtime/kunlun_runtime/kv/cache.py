"""The KV cache tensors: one preallocated pool per layer for K and one for V.

Each pool is a [num_blocks, stride] tensor whose rows follow ``BlockLayout`` (aligned start,
skewed stride); ``k_blocks[layer]`` is a [num_blocks, block_size, kv_heads, head_dim] view of the
payload. Nothing else allocates KV memory; its size comes from the memory budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kunlun_runtime.errors import ConfigError
from kunlun_runtime.kv.block_layout import BlockLayout, build_block_layout


class _LayerShape(Protocol):
    """What the cache needs of a model config (a ``ModelConfig``, or one rank's shard of it)."""

    @property
    def num_layers(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def for_model(cls, config: _LayerShape, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        """The cache of a model config (anything with num_layers, num_kv_heads and head_dim: a
        ``ModelConfig``, or one rank's shard of it)."""
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, block_size, dtype)

    @property
    def block_bytes(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return self.block_size * self.num_kv_heads * self.head_dim * element


def plan_num_blocks(spec: KVCacheSpec, layout: BlockLayout, memory_bytes: int, max_model_len: int) -> int:
    """How many blocks the budget holds (K and V, all layers, padding included).

    Raises ConfigError when it cannot hold one sequence of ``max_model_len`` tokens.
    """
    per_block = 2 * spec.num_layers * layout.stride_bytes
    num_blocks = memory_bytes // per_block
    needed = -(-max_model_len // spec.block_size)
    if num_blocks < needed:
        raise ConfigError(
            f"kv_cache_memory: {memory_bytes} bytes hold {num_blocks} blocks of {spec.block_size} tokens, "
            f"but one sequence of max_model_len={max_model_len} needs {needed} "
            f"({needed * per_block} bytes); raise --kv-cache-memory or lower --max-model-len",
            field="kv_cache_memory",
        )
    return int(num_blocks)


class KVCache:
    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        device: torch.device,
        *,
        cache_line_bytes: int,
        cache_num_sets: int,
        skew: bool,
    ) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        self.layout = build_block_layout(
            spec.block_bytes, cache_line_bytes=cache_line_bytes, cache_num_sets=cache_num_sets, skew=skew
        )
        self.k_blocks: list[torch.Tensor] = []
        self.v_blocks: list[torch.Tensor] = []
        for _ in range(spec.num_layers):
            self.k_blocks.append(self._allocate_pool(device))
            self.v_blocks.append(self._allocate_pool(device))

    def _allocate_pool(self, device: torch.device) -> torch.Tensor:
        spec, layout = self.spec, self.layout
        element = torch.empty((), dtype=spec.dtype).element_size()
        stride = layout.stride_bytes // element
        payload = layout.block_bytes // element
        align = layout.cache_line_bytes // element
        # Over-allocate by one line and start at the first aligned element.
        raw = torch.zeros(self.num_blocks * stride + align, dtype=spec.dtype, device=device)
        start = (-raw.data_ptr() // element) % align
        rows = raw[start : start + self.num_blocks * stride].view(self.num_blocks, stride)
        return rows[:, :payload].view(self.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)

    @property
    def nbytes(self) -> int:
        return 2 * self.spec.num_layers * self.num_blocks * self.layout.stride_bytes

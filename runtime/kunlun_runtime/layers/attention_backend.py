"""Which attention kernel a layer runs, decided per step: the one place that knows the kernel paths.

A model's attention module projects Q/K/V and the output; between the two it hands the heads to
``PagedAttention``, which picks the path for this step:

- ``native`` off (no CPU kernels for this dtype, or another platform): rotary in torch, K/V written
  by indexing, one fused SDPA over the paged cache (``paged_attention``);
- ``native`` on and every sequence decoding one token: one call of our decode kernel does rotary,
  the K/V write and attention;
- ``native`` on with decodes and prefill chunks together: the decodes through that same kernel
  (bit-identical to a decode-only step) and the chunks through the rotary/K-V-write kernel plus SDPA;
- ``native`` on with prefill chunks only: the rotary/K-V-write kernel, then SDPA.

The native paths also need a cache the tier's kernels read (``kernels_read_cache``: the AVX-512
tier's BF16 cache; the AVX2 tier's FP32 cache, or a BF16 one it widens as it reads); another
pairing (e.g. an FP32 cache under BF16 activations) takes the torch path, which the engine logs at
start. ``fused=False`` (the unfused reference, kept for the benchmark's ablation) always takes the
torch path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kunlun_runtime.layers import cpu_kernels
from kunlun_runtime.layers.attention import AttentionMetadata, MixedSplit, paged_attention
from kunlun_runtime.layers.kernel_choice import large_batches_in_fp32
from kunlun_runtime.layers.rotary import apply_rotary

# The KV cache dtypes each kernel tier reads, by the activation dtype it computes in.
_KERNEL_CACHE_DTYPES: dict[torch.dtype, frozenset[torch.dtype]] = {
    torch.bfloat16: frozenset({torch.bfloat16}),  # the AVX-512 tier
    torch.float32: frozenset({torch.float32, torch.bfloat16}),  # the AVX2 tier
}


def kernels_read_cache(activation_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the kernel tier of ``activation_dtype`` reads a KV cache of ``cache_dtype``."""
    return cache_dtype in _KERNEL_CACHE_DTYPES.get(activation_dtype, frozenset())


@dataclass(frozen=True, slots=True)
class AttentionShape:
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # K/V heads on this rank
    head_dim: int

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5


class PagedAttention:
    """Rotary, K/V write and attention over one layer's paged cache (see the module docstring)."""

    def __init__(self, shape: AttentionShape) -> None:
        self.shape = shape
        self.fused = True  # False only for the benchmark's unfused ablation
        self.native = False  # our CPU kernels; set by DecoderModel.enable_native_kernels

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        k_blocks: torch.Tensor,
        v_blocks: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] (before rotary) → attention output [T, H * D]."""
        if not (self.native and self.fused and kernels_read_cache(q.dtype, k_blocks.dtype)):
            q, k = apply_rotary(q, k, cos_sin)
            return self._sdpa(q, k, v, k_blocks, v_blocks, meta, kv_written=False)
        cos, sin = (table.view(-1, self.shape.head_dim) for table in cos_sin)
        if meta.max_query_len == 1:
            return self._decode(q, k, v, cos, sin, k_blocks, v_blocks, meta)
        if meta.split is not None:
            return self._mixed(q, k, v, cos, sin, k_blocks, v_blocks, meta.split)
        q, k = cpu_kernels.rotary_kv_write(
            q, k, v, cos, sin, k_blocks, v_blocks, meta.slot_block_ids, meta.slot_offsets
        )
        # A fresh prompt in FP32 where the native linears compute large batches so (same rule).
        wide = q.dtype == torch.bfloat16 and large_batches_in_fp32()
        return self._sdpa(q, k, v, k_blocks, v_blocks, meta, kv_written=True, prompt_in_fp32=wide)

    def _sdpa(
        self,
        q,
        k,
        v,
        k_blocks,
        v_blocks,
        meta: AttentionMetadata,
        *,
        kv_written: bool,
        prompt_in_fp32: bool = False,
    ) -> torch.Tensor:
        return paged_attention(
            q,
            k,
            v,
            k_blocks,
            v_blocks,
            meta,
            self.shape.scale,
            fused=self.fused,
            enable_gqa=self.shape.num_heads != self.shape.num_kv_heads,
            kv_written=kv_written,
            prompt_in_fp32=prompt_in_fp32,
        )

    def _decode(self, q, k, v, cos, sin, k_blocks, v_blocks, meta: AttentionMetadata) -> torch.Tensor:
        return cpu_kernels.decode_attention(
            q,
            k,
            v,
            cos,
            sin,
            k_blocks,
            v_blocks,
            meta.block_tables,
            meta.context_lens,
            self.shape.scale,
            meta.sliding_window,
        )

    def _mixed(self, q, k, v, cos, sin, k_blocks, v_blocks, split: MixedSplit) -> torch.Tensor:
        """Decodes and prefill chunks in one batch: the decodes through the decode kernel (the same
        call, and the same bits, as a decode-only step), the chunks through rotary_kv_write and
        paged attention among themselves."""
        out = q.new_empty((q.shape[0], self.shape.num_heads * self.shape.head_dim))
        rows = split.decode_rows
        q_d, k_d, v_d, cos_d, sin_d = (t.index_select(0, rows) for t in (q, k, v, cos, sin))
        out.index_copy_(0, rows, self._decode(q_d, k_d, v_d, cos_d, sin_d, k_blocks, v_blocks, split.decode))
        rows = split.prefill_rows
        q_p, k_p, v_p, cos_p, sin_p = (t.index_select(0, rows) for t in (q, k, v, cos, sin))
        q_p, k_p = cpu_kernels.rotary_kv_write(
            q_p,
            k_p,
            v_p,
            cos_p,
            sin_p,
            k_blocks,
            v_blocks,
            split.prefill.slot_block_ids,
            split.prefill.slot_offsets,
        )
        out.index_copy_(
            0, rows, self._sdpa(q_p, k_p, v_p, k_blocks, v_blocks, split.prefill, kv_written=True)
        )
        return out

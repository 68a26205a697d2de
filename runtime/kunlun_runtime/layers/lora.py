"""LoRA in the forward pass: each projection's adapter slots, and one step's rows → slots.

A projection with LoRA keeps ``max_loras`` slots of its adapters' low-rank weights, each slot
``parts`` pieces of ``max_rank`` (q/k/v are three pieces of ``qkv_proj``, gate/up two of
``gate_up_proj``): A as [slots, W, in] (W = parts·max_rank) and B transposed as [slots, W, out];
a smaller rank is zero-padded, the scaling folded into B (``lora.checkpoint``). The base
projection runs once for all rows; then each row gains its adapter's update ``(x·Aₛᵀ)·Bₛᵀ``.

Decode-sized batches on our CPU kernels do that in one operator (``cpu_kernels.lora_update``),
the same one the one-call decode step runs, so the two paths agree bit for bit: per slot in use
its A and B are read once for all its rows, the shrink and the expand accumulate in FP32 and
each output is rounded once; a base row costs nothing. PyTorch's BF16 matmul costs several times
more at these shapes. Larger batches (prefill) and CPUs without our kernels take PyTorch: two
matmuls when every row is on one adapter, else the rows grouped by slot. Rows of no adapter in
the whole batch: nothing runs (the model keeps its LoRA-free fast paths).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kunlun_runtime.layers import cpu_kernels

BASE_SLOT = -1  # a sequence on the base model


@dataclass(slots=True)
class LoRABatch:
    """One step's adapter of each row, as the projections read it."""

    row_slots: torch.Tensor  # [T] each row's slot (BASE_SLOT: the base model)
    single_slot: int | None  # every row on this slot
    _groups: list[tuple[int, torch.Tensor]] | None = None

    @classmethod
    def build(
        cls, sequence_slots: list[int], query_lens: list[int], device: torch.device
    ) -> LoRABatch | None:
        """The batch's rows → slots from each sequence's slot and length; None when no row uses
        an adapter."""
        if not sequence_slots or all(slot == BASE_SLOT for slot in sequence_slots):
            return None
        distinct = set(sequence_slots)
        single = next(iter(distinct)) if len(distinct) == 1 else None
        slots = torch.tensor(sequence_slots, dtype=torch.long, device=device)
        lens = torch.tensor(query_lens, dtype=torch.long, device=device)
        return cls(torch.repeat_interleave(slots, lens), single)

    def groups(self) -> list[tuple[int, torch.Tensor]]:
        """Each slot in use and the rows on it."""
        if self._groups is None:
            self._groups = [
                (slot, (self.row_slots == slot).nonzero().flatten())
                for slot in sorted(set(self.row_slots.tolist()) - {BASE_SLOT})
            ]
        return self._groups


class LoRAProjection:
    """The adapter slots of one (fused, per-rank) projection."""

    def __init__(
        self,
        num_slots: int,
        parts: int,
        max_rank: int,
        in_features: int,
        out_features: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_slots, self.parts, self.max_rank = num_slots, parts, max_rank
        self.width = parts * max_rank  # a slot's columns
        self.a = torch.zeros(num_slots, self.width, in_features, dtype=dtype, device=device)
        # B transposed, [slots, W, out]: the kernel's expand is then vector multiply-adds along out.
        self.b = torch.zeros(num_slots, self.width, out_features, dtype=dtype, device=device)
        self.native = False  # decode-sized batches through cpu_kernels.lora_update (set with the kernels)

    @property
    def tensors(self) -> list[torch.Tensor]:
        """What ``cpu_kernels.lora_update`` and the one-call decode step take."""
        return [self.a, self.b]

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes

    def install(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Put an adapter's pieces (A [parts, r, in], B [out, parts, r], this rank's share) in
        ``slot``; None: the adapter leaves this projection alone (zeros)."""
        slot_a = self.a[slot].view(self.parts, self.max_rank, -1)
        slot_b = self.b[slot].view(self.parts, self.max_rank, -1)
        slot_a.zero_()
        slot_b.zero_()
        if a is not None and b is not None:
            rank = a.shape[1]
            slot_a[:, :rank].copy_(a)
            slot_b[:, :rank].copy_(b.permute(1, 2, 0))

    def add_update(self, x: torch.Tensor, out: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
        """``out`` (the base projection of ``x``) plus each row's adapter update."""
        if self.native and x.dim() == 2 and x.shape[0] <= cpu_kernels.MAX_ROWS:
            return cpu_kernels.lora_update(x.contiguous(), out.contiguous(), self.a, self.b, batch.row_slots)
        if batch.single_slot is not None:
            slot = batch.single_slot
            return out + F.linear(x, self.a[slot]) @ self.b[slot]
        out = out.clone()
        for slot, rows in batch.groups():
            update = F.linear(x.index_select(0, rows), self.a[slot]) @ self.b[slot]
            out.index_add_(0, rows, update)
        return out

"""Decode attention over some of a step's rows, as the kernel tests call it: the rows together on
some number of threads, and each row alone, which must give it the same bits."""

from __future__ import annotations

import torch

from kunlun_runtime.layers import cpu_kernels


def attend_rows(
    inputs, cache, meta, rows: slice, scale: float, window: int = 0, threads: int = 1
) -> torch.Tensor:
    """``cpu_kernels.decode_attention`` over ``rows`` of ``inputs`` (q, k, v, cos, sin) and of the
    step's metadata, on ``threads`` intra-op threads."""
    q, k, v, cos, sin = inputs
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return cpu_kernels.decode_attention(
            q[rows], k[rows], v[rows], cos[rows], sin[rows], cache.k_blocks[0], cache.v_blocks[0],
            meta.block_tables[rows], meta.context_lens[rows], scale, window,
        )  # fmt: skip
    finally:
        torch.set_num_threads(before)


def assert_each_row_as_alone(
    inputs, cache, meta, together: torch.Tensor, rows: int, scale: float, window: int = 0
):
    """Rows 0 .. rows - 1 of ``together`` equal, bit for bit, each row's call of its own on one
    thread (made after the call that wrote every row's key and value: a row's own call writes its
    own again, unchanged)."""
    for b in range(rows):
        alone = attend_rows(inputs, cache, meta, slice(b, b + 1), scale, window)
        assert torch.equal(together[b], alone[0]), f"row {b} of {meta.context_lens.tolist()}"

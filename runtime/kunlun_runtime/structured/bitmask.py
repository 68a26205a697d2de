"""Applying allowed-token bitmasks to logits.

A bitmask row holds one bit per token (bit ``t % 32`` of int32 word ``t // 32``), as the grammar
engine fills it. On the CPU, numpy's ``unpackbits`` turns a row into one byte per token in a single
C loop, several times faster than llguidance's generic torch fallback, and the masked fill is one
pass over the row. For an accelerator the packed words travel (32 times fewer bytes than one per
token) and are unpacked there with shifts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def apply_token_bitmask(logits: torch.Tensor, bitmask: np.ndarray, rows: Sequence[int]) -> None:
    """Set ``logits[rows[i], t]`` to -inf for every token ``t`` that row ``i`` of ``bitmask``
    does not allow, in place. ``logits`` [S, V] on any device; ``bitmask`` [len(rows), ⌈V/32⌉]
    int32."""
    vocab_size = logits.shape[1]
    if logits.device.type == "cpu":
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, count=vocab_size, bitorder="little")
        np.bitwise_xor(bits, 1, out=bits)  # 1 = disallowed, in place: no second array
        disallowed = torch.from_numpy(bits.view(np.bool_))
    else:
        words = torch.from_numpy(bitmask).to(logits.device, non_blocking=True)
        disallowed = disallowed_from_words(words, vocab_size)
    if list(rows) == list(range(logits.shape[0])):  # every row constrained: mask in place
        logits.masked_fill_(disallowed, float("-inf"))
        return
    index = torch.tensor(list(rows), dtype=torch.long, device=logits.device)
    logits[index] = logits.index_select(0, index).masked_fill_(disallowed, float("-inf"))


def disallowed_from_words(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The bool [rows, vocab_size] of tokens whose bit is clear in int32 ``words``, computed with
    shifts wherever ``words`` is (the accelerator's path)."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab_size] == 0

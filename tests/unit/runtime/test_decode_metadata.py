"""A decode step's attention metadata, worked out on lists (``_decode_metadata``), is the general
construction's (``_batch_metadata``) field for field: values, dtypes and shapes, with and without a
sliding window, at block boundaries and with block tables of different lengths."""

import random

import pytest
import torch

from kunlun_runtime.layers import attention
from kunlun_runtime.layers.attention import build_attention_metadata

BLOCK = 16
TENSOR_FIELDS = (
    "slot_block_ids",
    "slot_offsets",
    "block_tables",
    "query_padded_index",
    "attn_mask",
    "context_lens",
)


def _batch(seed: int, num_seqs: int) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(seed)
    context_lens, tables = [], []
    for _ in range(num_seqs):
        # 1, a block's last slot, the next block's first, or anywhere up to 8 blocks
        length = rng.choice([1, BLOCK, BLOCK + 1, rng.randint(2, 8 * BLOCK)])
        blocks = (length + BLOCK - 1) // BLOCK + rng.randint(0, 2)  # tables may hold spare blocks
        context_lens.append(length)
        tables.append(rng.sample(range(64), blocks))
    return context_lens, tables


@pytest.mark.parametrize("window", [None, 1, 5, 40])
@pytest.mark.parametrize(("seed", "num_seqs"), [(0, 1), (1, 2), (2, 8), (3, 33)])
def test_decode_metadata_equals_the_general_construction(seed, num_seqs, window):
    context_lens, tables = _batch(seed, num_seqs)
    device = torch.device("cpu")
    fast = attention._decode_metadata(context_lens, tables, BLOCK, device, window)
    general = attention._batch_metadata([1] * num_seqs, context_lens, tables, BLOCK, device, window)
    for name in TENSOR_FIELDS:
        ours, theirs = getattr(fast, name), getattr(general, name)
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, name
        assert torch.equal(ours, theirs), name
    for name in ("max_query_len", "sliding_window", "is_fresh_single_prefill", "split"):
        assert getattr(fast, name) == getattr(general, name), name


def test_only_all_decode_steps_take_the_list_construction(monkeypatch):
    taken = []
    real = attention._decode_metadata
    monkeypatch.setattr(attention, "_decode_metadata", lambda *a: taken.append(a) or real(*a))
    build_attention_metadata([1, 1], [5, 20], [[3], [4, 9]], BLOCK, torch.device("cpu"))
    mixed = build_attention_metadata([1, 4], [5, 20], [[3], [4, 9]], BLOCK, torch.device("cpu"))
    # the mixed step's decode part is itself a decode batch: it takes the list construction too
    assert len(taken) == 2 and mixed.split is not None and mixed.split.decode.max_query_len == 1

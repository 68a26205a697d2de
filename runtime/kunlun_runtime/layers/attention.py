"""Paged attention: write this step's K/V into the block pool, attend over each sequence's blocks.

One batch mixes prefill chunks and decodes. Queries of all sequences are flattened into [T, ...];
for attention they are scattered into a padded [B, max_query_len] layout, each sequence's K/V is
gathered block-wise from its block table, and one fused scaled-dot-product-attention call per
layer computes QKᵀ → scale → mask → softmax → ·V (no per-sequence Python loop).

A batch that holds both decodes and prefill chunks attends in two parts (``MixedSplit``): the
decodes as a decode batch and the chunks padded among themselves. Padded together, every decode
would be padded to the longest chunk and cost as much attention as that chunk.

The pool may hold another dtype than the activations (``--kv-cache-dtype``: BF16 K/V under FP32
activations on CPUs without native BF16). K/V are rounded to the pool's dtype as they are written,
and attention always reads them as stored, widened to the queries' dtype after the gather: every
path (this one, the kernels, a fresh prompt, a prefix reused from the cache) sees the same keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step tensors shared by every layer (built once per step by the model runner)."""

    slot_block_ids: torch.Tensor  # [T] block holding each new token's K/V
    slot_offsets: torch.Tensor  # [T] offset of that token inside its block
    block_tables: torch.Tensor  # [B, max_blocks] block ids per sequence (padded with 0)
    query_padded_index: torch.Tensor  # [T] row of each token in the padded [B * max_query_len] layout
    attn_mask: torch.Tensor  # [B, 1, max_query_len, max_blocks * block_size] True = may attend
    max_query_len: int
    context_lens: torch.Tensor  # [B] tokens in KV after this step (int64)
    sliding_window: int = 0  # 0: attend to the whole context
    is_fresh_single_prefill: bool = False  # one sequence prefilled from position 0 (no earlier KV)
    split: MixedSplit | None = None  # decodes and prefill chunks together: attend in two parts


@dataclass(slots=True)
class MixedSplit:
    """The two parts of a batch of decodes and prefill chunks, each with its own metadata over
    its own sequences (in batch order) and the flat token rows it covers."""

    decode_rows: torch.Tensor  # [num decodes] row of each one-token sequence
    decode: AttentionMetadata
    prefill_rows: torch.Tensor  # [prefill tokens] rows of the multi-token sequences
    prefill: AttentionMetadata


def build_attention_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    sliding_window: int | None = None,
) -> AttentionMetadata:
    """Metadata for a batch: sequence b computes ``query_lens[b]`` new tokens and has
    ``context_lens[b]`` tokens in KV after this step (new ones included)."""
    if min(query_lens) == 1 == max(query_lens):
        return _decode_metadata(context_lens, block_tables, block_size, device, sliding_window)
    return _batch_metadata(query_lens, context_lens, block_tables, block_size, device, sliding_window)


def _decode_metadata(
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    sliding_window: int | None,
) -> AttentionMetadata:
    """``_batch_metadata``'s tensors for a step in which every sequence decodes one token, worked
    out on the lists: the general construction's twenty small tensor operations took a few times
    the host time, every step (docs/performance.md)."""
    positions = [length - 1 for length in context_lens]
    max_blocks = max(len(table) for table in block_tables)
    padded = [table + [0] * (max_blocks - len(table)) for table in block_tables]
    ctx_lens = torch.tensor(context_lens, dtype=torch.int64)
    key_pos = torch.arange(max_blocks * block_size).view(1, 1, -1)
    query_pos = torch.tensor(positions, dtype=torch.int64).view(-1, 1, 1)
    mask = key_pos <= query_pos
    if sliding_window is not None:
        mask &= key_pos > query_pos - sliding_window
    slot_blocks = [
        table[position // block_size] for table, position in zip(block_tables, positions, strict=True)
    ]
    return AttentionMetadata(
        slot_block_ids=torch.tensor(slot_blocks, dtype=torch.int64, device=device),
        slot_offsets=torch.tensor([p % block_size for p in positions], dtype=torch.int64, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int64, device=device),
        query_padded_index=torch.arange(len(positions), device=device),
        attn_mask=mask.unsqueeze(1).to(device),
        max_query_len=1,
        context_lens=ctx_lens.to(device),
        sliding_window=sliding_window or 0,
    )


def _batch_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    sliding_window: int | None,
) -> AttentionMetadata:
    """Any batch: prefill chunks, decodes, or both (then in two parts)."""
    split = None
    if 1 in query_lens and max(query_lens) > 1:
        split = _split_mixed(query_lens, context_lens, block_tables, block_size, device, sliding_window)
    num_seqs = len(query_lens)
    max_q = max(query_lens)
    max_blocks = max(len(table) for table in block_tables)
    q_lens = torch.tensor(query_lens, dtype=torch.int64)
    ctx_lens = torch.tensor(context_lens, dtype=torch.int64)
    tables = torch.zeros((num_seqs, max_blocks), dtype=torch.int64)
    for row, table in enumerate(block_tables):
        tables[row, : len(table)] = torch.tensor(table, dtype=torch.int64)

    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), q_lens)
    starts = torch.cumsum(q_lens, 0) - q_lens
    index_in_seq = torch.arange(int(q_lens.sum())) - starts[seq_of_token]
    positions = (ctx_lens - q_lens)[seq_of_token] + index_in_seq
    slot_block_ids = tables[seq_of_token, positions // block_size]

    if split is None:
        # Query i of sequence b sits at absolute position ctx_b - q_b + i and sees keys j <= that.
        query_pos = (ctx_lens - q_lens).unsqueeze(1) + torch.arange(max_q).unsqueeze(0)  # [B, max_q]
        key_pos = torch.arange(max_blocks * block_size)
        mask = key_pos.view(1, 1, -1) <= query_pos.unsqueeze(-1)
        if sliding_window is not None:
            mask &= key_pos.view(1, 1, -1) > query_pos.unsqueeze(-1) - sliding_window
        # Padding query rows attend to key 0 only, so softmax never sees an all-masked row.
        is_pad = torch.arange(max_q).unsqueeze(0) >= q_lens.unsqueeze(1)
        mask[is_pad] = key_pos == 0
        padded_index = seq_of_token * max_q + index_in_seq
    else:  # each part has its own mask and padding
        mask = torch.zeros((0,), dtype=torch.bool)
        padded_index = torch.zeros((0,), dtype=torch.int64)
    return AttentionMetadata(
        slot_block_ids=slot_block_ids.to(device),
        slot_offsets=(positions % block_size).to(device),
        block_tables=tables.to(device),
        query_padded_index=padded_index.to(device),
        attn_mask=mask.unsqueeze(1).to(device),
        max_query_len=max_q,
        context_lens=ctx_lens.to(device),
        sliding_window=sliding_window or 0,
        is_fresh_single_prefill=(
            num_seqs == 1 and max_q > 1 and context_lens[0] == query_lens[0] and sliding_window is None
        ),
        split=split,
    )


def _split_mixed(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    sliding_window: int | None,
) -> MixedSplit:
    first_row = [0]
    for length in query_lens[:-1]:
        first_row.append(first_row[-1] + length)
    parts = {}
    for name, seqs in (
        ("decode", [b for b, length in enumerate(query_lens) if length == 1]),
        ("prefill", [b for b, length in enumerate(query_lens) if length > 1]),
    ):
        rows = [row for b in seqs for row in range(first_row[b], first_row[b] + query_lens[b])]
        meta = build_attention_metadata(
            [query_lens[b] for b in seqs],
            [context_lens[b] for b in seqs],
            [block_tables[b] for b in seqs],
            block_size,
            device,
            sliding_window=sliding_window,
        )
        parts[name] = (torch.tensor(rows, dtype=torch.int64, device=device), meta)
    return MixedSplit(*parts["decode"], *parts["prefill"])


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    fused: bool = True,
    enable_gqa: bool | None = None,
    kv_written: bool = False,
    prompt_in_fp32: bool = False,
) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] → attention output [T, H * D]; stores k/v in the pool unless
    ``kv_written`` says the caller already has. ``prompt_in_fp32``: a fresh prompt's attention
    computes in FP32 (``fresh_prompt_attention``).

    ``fused=False`` is the unfused reference path (QKᵀ, mask, softmax, ·V as separate ops with
    the full score matrix materialised), kept for the benchmark's ablation table.
    """
    if not kv_written:
        k_blocks[meta.slot_block_ids, meta.slot_offsets] = k.to(k_blocks.dtype)
        v_blocks[meta.slot_block_ids, meta.slot_offsets] = v.to(v_blocks.dtype)
    num_heads, head_dim = q.shape[1], q.shape[2]
    gqa = num_heads != k.shape[1] if enable_gqa is None else enable_gqa
    if meta.split is not None:
        out = q.new_empty((q.shape[0], num_heads * head_dim))
        for rows, part in (
            (meta.split.decode_rows, meta.split.decode),
            (meta.split.prefill_rows, meta.split.prefill),
        ):
            part_out = paged_attention(
                q.index_select(0, rows),
                k.index_select(0, rows),
                v.index_select(0, rows),
                k_blocks,
                v_blocks,
                part,
                scale,
                fused=fused,
                enable_gqa=gqa,
                kv_written=True,
            )
            out.index_copy_(0, rows, part_out)
        return out
    if fused and meta.is_fresh_single_prefill:
        # One prompt from position 0: its own K/V are the whole context, so attend to them as they
        # are (no gather from the pool; the pool holds the same values, once rounded to its dtype).
        k, v = as_stored(k, k_blocks), as_stored(v, v_blocks)
        return fresh_prompt_attention(q, k, v, scale, gqa, in_fp32=prompt_in_fp32)

    num_seqs, max_blocks = meta.block_tables.shape
    # index_select on the flattened table copies whole blocks, far cheaper than advanced indexing.
    flat_table = meta.block_tables.view(-1)
    block_size, kv_heads = k_blocks.shape[1], k_blocks.shape[2]
    gathered_shape = (num_seqs, max_blocks * block_size, kv_heads, head_dim)
    # A pool in another dtype is widened after the gather (only the blocks read are converted).
    keys = (
        k_blocks.index_select(0, flat_table).to(q.dtype).view(gathered_shape).transpose(1, 2)
    )  # [B, KVH, L, D]
    values = v_blocks.index_select(0, flat_table).to(q.dtype).view(gathered_shape).transpose(1, 2)
    decode_only = meta.max_query_len == 1  # one query per sequence: no scatter/gather needed
    if decode_only:
        queries = q.unsqueeze(2)  # [B, H, 1, D]
    else:
        padded = q.new_zeros((num_seqs * meta.max_query_len, num_heads, head_dim))
        padded[meta.query_padded_index] = q
        queries = padded.view(num_seqs, meta.max_query_len, num_heads, head_dim).transpose(1, 2)
    if fused:
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=meta.attn_mask, scale=scale, enable_gqa=gqa
        )
    else:
        out = _unfused_attention(queries, keys, values, meta.attn_mask, scale)
    if decode_only:
        return out.reshape(num_seqs, num_heads * head_dim)
    out = out.transpose(1, 2).reshape(num_seqs * meta.max_query_len, num_heads * head_dim)
    return out[meta.query_padded_index]


def as_stored(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``x`` as the pool ``blocks`` holds it, back in ``x``'s dtype: rounded through the pool's
    dtype where the two differ (BF16 K/V under FP32 activations), else ``x`` itself."""
    return x if blocks.dtype == x.dtype else x.to(blocks.dtype).to(x.dtype)


def fresh_prompt_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    enable_gqa: bool,
    in_fp32: bool = False,
) -> torch.Tensor:
    """Causal attention of one prompt over its own keys, q [T, H, D], k/v [T, KVH, D] → [T, H * D]:
    plain causal SDPA, which takes its flash path (the long-prompt TTFT case). ``in_fp32``: q/k/v
    widened to FP32 and the output rounded back to their dtype (where the native backend's
    ``large_batches_in_fp32``: SDPA's FP32 kernel took 0.70-0.81 of its BF16 one's time on a CPU
    whose FMAs outrun its BF16 dot products, the casts included)."""
    dtype = q.dtype
    if in_fp32:
        q, k, v = q.float(), k.float(), v.float()
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        is_causal=True,
        scale=scale,
        enable_gqa=enable_gqa,
    )
    return out.squeeze(0).transpose(0, 1).reshape(q.shape[0], q.shape[1] * q.shape[2]).to(dtype)


def _unfused_attention(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    groups = queries.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(groups, dim=1)
    values = values.repeat_interleave(groups, dim=1)
    scores = torch.matmul(queries, keys.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(values.dtype), values)

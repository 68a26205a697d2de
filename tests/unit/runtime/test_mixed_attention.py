"""A batch of decodes and prefill chunks attends in two parts (``MixedSplit``): checked against
attention computed one sequence at a time from the whole context, in FP32 and on the native BF16
path, and the decodes of a mixed step against a decode-only step of the same sequences. A BF16 pool
under FP32 activations (``--kv-cache-dtype bfloat16`` on CPUs without native BF16) stores the new
K/V rounded and attends in FP32 over what it stores, on every path."""

import pytest
import torch

from kunlun_runtime.layers import cpu_kernels
from kunlun_runtime.layers.attention import build_attention_metadata, paged_attention
from kunlun_runtime.layers.rotary import RopeConfig, RotaryEmbedding, apply_rotary

BLOCK = 16
# A decode at 17, a 5-token chunk after 30 cached tokens, a decode at 40, a fresh 23-token prompt.
QUERY_LENS = [1, 5, 1, 23]
CONTEXT_LENS = [17, 35, 40, 23]
TABLES = [[3, 7], [5, 0, 9], [11, 2, 4], [8, 6]]
HEADS, KV_HEADS, HEAD_DIM = 6, 2, 64


def _case(dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(12, BLOCK, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
    v_pool = torch.randn(12, BLOCK, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
    tokens = sum(QUERY_LENS)
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=generator).to(dtype)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
    v = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
    positions = torch.cat([torch.arange(c - n, c) for n, c in zip(QUERY_LENS, CONTEXT_LENS, strict=True)])
    return k_pool, v_pool, q, k, v, positions


def _reference(k_pool, v_pool, q, k, v, window: int | None) -> torch.Tensor:
    """Each sequence on its own: its context is the pool's tokens before the new ones, then the
    new ones; every query sees the keys at or before its position (and inside the window)."""
    outputs, row = [], 0
    for n, c, table in zip(QUERY_LENS, CONTEXT_LENS, TABLES, strict=True):
        slots = [(table[p // BLOCK], p % BLOCK) for p in range(c - n)]
        keys = torch.cat([k_pool[[b for b, _ in slots], [o for _, o in slots]], k[row : row + n]])
        values = torch.cat([v_pool[[b for b, _ in slots], [o for _, o in slots]], v[row : row + n]])
        keys = keys.double().repeat_interleave(HEADS // KV_HEADS, dim=1)  # [c, H, D]
        values = values.double().repeat_interleave(HEADS // KV_HEADS, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[row : row + n].double(), keys) * HEAD_DIM**-0.5
        query_pos = torch.arange(c - n, c).view(-1, 1)
        key_pos = torch.arange(c).view(1, -1)
        visible = key_pos <= query_pos
        if window is not None:
            visible &= key_pos > query_pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).reshape(n, HEADS * HEAD_DIM))
        row += n
    return torch.cat(outputs)


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("fused", [True, False])
def test_fp32_mixed_batch_equals_attention_one_sequence_at_a_time(window, fused):
    k_pool, v_pool, q, k, v, _ = _case(torch.float32)
    expected = _reference(k_pool, v_pool, q, k, v, window)
    meta = build_attention_metadata(QUERY_LENS, CONTEXT_LENS, TABLES, BLOCK, torch.device("cpu"), window)
    assert meta.split is not None
    assert meta.split.decode_rows.tolist() == [0, 6]
    assert meta.split.prefill_rows.tolist() == [*range(1, 6), *range(7, 30)]
    assert meta.split.decode.max_query_len == 1 and meta.split.prefill.max_query_len == 23
    out = paged_attention(q, k, v, k_pool, v_pool, meta, HEAD_DIM**-0.5, fused=fused)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    # The step's new K/V are in the pool where the slot mapping says.
    assert torch.equal(k_pool[meta.slot_block_ids, meta.slot_offsets], k)
    assert torch.equal(v_pool[meta.slot_block_ids, meta.slot_offsets], v)


def _as_bf16(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """What a BF16 pool holds of FP32 values, widened back to FP32."""
    return [t.to(torch.bfloat16).float() for t in tensors]


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("fused", [True, False])
def test_plain_path_over_a_bf16_pool_attends_in_fp32_over_the_rounded_keys_and_values(window, fused):
    k_src, v_src, q, k, v, _ = _case(torch.float32)
    k_pool, v_pool = k_src.to(torch.bfloat16), v_src.to(torch.bfloat16)
    expected = _reference(*_as_bf16(k_pool, v_pool), q, *_as_bf16(k, v), window)
    meta = build_attention_metadata(QUERY_LENS, CONTEXT_LENS, TABLES, BLOCK, torch.device("cpu"), window)
    out = paged_attention(q, k, v, k_pool, v_pool, meta, HEAD_DIM**-0.5, fused=fused)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(k_pool[meta.slot_block_ids, meta.slot_offsets], k.to(torch.bfloat16))
    assert torch.equal(v_pool[meta.slot_block_ids, meta.slot_offsets], v.to(torch.bfloat16))


def test_a_fresh_prompt_over_a_bf16_pool_sees_its_keys_as_stored():
    # The fused path attends to a fresh prompt's own K/V without reading the pool; the unfused one
    # reads them back from it. Both must see the same (rounded) keys: a prompt's attention may not
    # depend on whether its prefix came from the cache.
    _, _, q, k, v, _ = _case(torch.float32)
    rows = slice(7, 30)  # the 23-token prompt
    meta = build_attention_metadata([23], [23], [TABLES[3]], BLOCK, torch.device("cpu"))
    assert meta.is_fresh_single_prefill
    outputs = []
    for fused in (True, False):
        k_pool = torch.zeros(12, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
        v_pool = torch.zeros_like(k_pool)
        outputs.append(paged_attention(q[rows], k[rows], v[rows], k_pool, v_pool, meta, 0.125, fused=fused))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-6)


def test_batches_of_one_kind_are_not_split():
    decode_only = build_attention_metadata([1, 1], [17, 40], TABLES[:2], BLOCK, torch.device("cpu"))
    prefill_only = build_attention_metadata([5, 23], [35, 23], TABLES[1:3], BLOCK, torch.device("cpu"))
    assert decode_only.split is None and prefill_only.split is None
    assert prefill_only.attn_mask.shape == (2, 1, 23, 3 * BLOCK)


@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.float32, torch.bfloat16)],
    ids=["avx512-tier", "avx2-tier", "avx2-tier-bf16-kv"],
)
@pytest.mark.parametrize("window", [None, 9])
def test_native_mixed_step_matches_the_reference_and_its_decodes_match_a_decode_only_step(
    window, dtype, cache_dtype
):
    from kunlun_runtime.kv.cache import KVCache, KVCacheSpec
    from kunlun_runtime.layers.attention_backend import AttentionShape, PagedAttention

    if not cpu_kernels.load(dtype):
        pytest.skip(str(cpu_kernels.unavailable_reason(dtype)))
    k_src, v_src, q, k, v, positions = _case(dtype, seed=1)
    cache = KVCache(
        KVCacheSpec(1, KV_HEADS, HEAD_DIM, BLOCK, cache_dtype), 12, torch.device("cpu"), cache_line_bytes=64,
        cache_num_sets=64, skew=True,  # strided blocks, as the engine lays them out
    )  # fmt: skip
    cache.k_blocks[0].copy_(k_src)
    cache.v_blocks[0].copy_(v_src)
    cos_sin = RotaryEmbedding(HEAD_DIM, RopeConfig(theta=10000.0), 64).lookup(positions, dtype)
    qr, kr = apply_rotary(q, k, cos_sin)
    stored = [t.to(cache_dtype).to(dtype) for t in (k_src, v_src, kr, v)]  # the pool's view of them
    expected = _reference(stored[0], stored[1], qr, stored[2], stored[3], window)

    attention = PagedAttention(AttentionShape(HEADS, KV_HEADS, HEAD_DIM))
    attention.native = True  # the mixed batch goes through the native mixed path
    meta = build_attention_metadata(QUERY_LENS, CONTEXT_LENS, TABLES, BLOCK, torch.device("cpu"), window)
    assert meta.split is not None and meta.max_query_len > 1
    out = attention.forward(q, k, v, cos_sin, cache.k_blocks[0], cache.v_blocks[0], meta)
    # BF16: one output rounding plus the BF16 probabilities; FP32: accumulation-order noise.
    bound = (
        (2**-7 * expected.abs() + 2e-2 * expected.abs().max())
        if dtype == torch.bfloat16
        else 1e-5 * expected.abs().max()
    )
    assert ((out.double() - expected).abs() <= bound).all()
    assert torch.equal(cache.k_blocks[0][meta.slot_block_ids, meta.slot_offsets], kr.to(cache_dtype))
    assert torch.equal(cache.v_blocks[0][meta.slot_block_ids, meta.slot_offsets], v.to(cache_dtype))

    # The decodes alone, as a decode-only step over the same pool: the same bits.
    cache.k_blocks[0].copy_(k_src)
    cache.v_blocks[0].copy_(v_src)
    rows = meta.split.decode_rows
    decode_meta = build_attention_metadata(
        [1, 1], [17, 40], [TABLES[0], TABLES[2]], BLOCK, torch.device("cpu"), window
    )
    cos, sin = (t.view(-1, HEAD_DIM) for t in cos_sin)
    alone = cpu_kernels.decode_attention(
        q[rows], k[rows], v[rows], cos[rows], sin[rows], cache.k_blocks[0], cache.v_blocks[0],
        decode_meta.block_tables, decode_meta.context_lens, HEAD_DIM**-0.5, window or 0,
    )  # fmt: skip
    assert torch.equal(out[rows], alone)


def test_a_fresh_prompt_attends_in_fp32_where_asked_and_returns_its_own_dtype() -> None:
    """``fresh_prompt_attention`` in FP32 (where large batches compute in FP32, or asked): BF16
    q/k/v widened, SDPA's FP32 kernel, the output rounded back once; in BF16 otherwise. Both
    within BF16's rounding of an FP64 reference."""
    from kunlun_runtime.layers.attention import fresh_prompt_attention

    generator = torch.Generator().manual_seed(3)
    tokens = 37
    q, k, v = (
        torch.randn(tokens, h, HEAD_DIM, generator=generator).bfloat16() for h in (HEADS, KV_HEADS, KV_HEADS)
    )
    scale = HEAD_DIM**-0.5
    groups = HEADS // KV_HEADS
    scores = torch.einsum("thd,shd->hts", q.double(), k.double().repeat_interleave(groups, 1)) * scale
    scores = scores.masked_fill(torch.ones(tokens, tokens, dtype=torch.bool).triu(1), float("-inf"))
    reference = torch.einsum("hts,shd->thd", scores.softmax(-1), v.double().repeat_interleave(groups, 1))
    reference = reference.reshape(tokens, HEADS * HEAD_DIM)
    wide = fresh_prompt_attention(q, k, v, scale, True, in_fp32=True)
    narrow = fresh_prompt_attention(q, k, v, scale, True, in_fp32=False)
    assert wide.dtype == narrow.dtype == torch.bfloat16
    widened = torch.nn.functional.scaled_dot_product_attention(
        *(t.float().transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
        is_causal=True,
        scale=scale,
        enable_gqa=True,
    )
    assert torch.equal(wide, widened.squeeze(0).transpose(0, 1).reshape(tokens, -1).bfloat16())
    for out in (wide, narrow):
        assert (out.double() - reference).abs().max() <= 2**-7 * reference.abs().max()

"""The AVX2 tier's decode operators (csrc/avx2/decode_ops.cpp, decode_attention.cpp, argmax.cpp) on
FP32 activations, against the FP32 PyTorch paths they replace.

Bounds: the kernels do the references' FP32 arithmetic in another order and with their own exp
(relative error ~2e-7), so results differ by a few FP32 ulps (2**-24 ≈ 6e-8 each): 1e-5 relative
leaves a margin of 20x or more over the errors measured (≤ 3e-7 for the norms and SiLU; for
attention ≤ 5e-7 of the largest |V|, and as close to a float64 reference as torch's FP32 SDPA is;
its output is a convex combination of V rows that can cancel to near zero, so its bound is relative
to that scale rather than to each element). Rotary, the residual add and the cache writes are
exact: each product and sum is rounded once, as the eager expressions round them.

The KV cache may be BF16 under the FP32 activations (``--kv-cache-dtype``): the kernels round K/V
to nearest even as they write them, bit for bit as the runtime's ``.to(torch.bfloat16)``, and widen
them as they read, so against the paged path over the same BF16 pool the bounds are the FP32 ones.
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F

from kunlun_runtime.kv.cache import KVCache, KVCacheSpec
from kunlun_runtime.layers import cpu_kernels
from kunlun_runtime.layers.attention import build_attention_metadata, paged_attention
from kunlun_runtime.layers.rotary import RopeConfig, RotaryEmbedding, apply_rotary
from tests.support.decode_attention_rows import assert_each_row_as_alone, attend_rows
from tests.support.kernel_marks import needs_kernels

pytestmark = needs_kernels(torch.float32)

REL = 1e-5
BLOCK = 16
TINY = torch.finfo(torch.float32).tiny  # the smallest normal FP32


def _avx2_ops():
    """The AVX2 library's ops themselves (cpu_kernels.argmax_rows may pick the AVX-512 tier)."""
    return torch.ops.kunlun_avx2


@contextlib.contextmanager
def _threads(count: int):
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _assert_rel(actual: torch.Tensor, expected: torch.Tensor, rel: float = REL) -> None:
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    error = (actual.double() - expected.double()).abs()
    assert (error <= rel * expected.double().abs()).all(), (error / expected.double().abs()).max()


# ---- RMSNorm, residual add, SiLU ----------------------------------------------------------------


def _hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)  # HF LlamaRMSNorm, all in FP32
    return weight * (x * torch.rsqrt(variance + eps))


# A decode row of SmolLM2; vector tails (100, 7: masked loads only); prefill-sized rows.
@pytest.mark.parametrize("rows,hidden", [(1, 576), (5, 100), (37, 7), (3, 4096)])
def test_rms_norm_matches_hf_rms_norm_in_fp32(rows, hidden):
    generator = torch.Generator().manual_seed(hidden)
    x = torch.randn(rows, hidden, generator=generator) * 4
    weight = torch.randn(hidden, generator=generator)
    _assert_rel(cpu_kernels.rms_norm(x, weight, 1e-5), _hf_rms_norm(x, weight, 1e-5))


@pytest.mark.parametrize("rows,hidden", [(2, 576), (19, 13)])
def test_add_rms_norm_returns_the_exact_sum_and_its_norm(rows, hidden):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=generator) * 3
    delta = torch.randn(rows, hidden, generator=generator)
    weight = torch.randn(hidden, generator=generator)
    total, normed = cpu_kernels.add_rms_norm(x, delta, weight, 1e-6)
    assert torch.equal(total, x + delta)  # one FP32 rounding, as the eager add
    _assert_rel(normed, _hf_rms_norm(x + delta, weight, 1e-6))


@pytest.mark.parametrize("rows,inner", [(1, 1536), (4, 37)])  # a decode row; a lane tail
def test_silu_mul_matches_f_silu_times_up(rows, inner):
    generator = torch.Generator().manual_seed(inner)
    gate_up = torch.randn(rows, 2 * inner, generator=generator) * 4
    gate, up = gate_up.split(inner, dim=-1)
    _assert_rel(cpu_kernels.silu_mul(gate_up), F.silu(gate) * up)


def test_silu_mul_is_accurate_for_every_finite_gate_and_keeps_nan():
    # Every gate from -120 to 120 (past exp's FP32 range both ways), against float64: 1e-6 relative
    # where the result is a normal float (torch's own silu returns -0 below -88.7, where the true
    # value is still normal); a few subnormal ulps (2**-149 each) where it is subnormal.
    gate = torch.cat([torch.linspace(-120, 120, 240_001), torch.tensor([1e-30, -1e-30, 0.0, 1e38, -1e38])])
    up = torch.rand(gate.numel(), generator=torch.Generator().manual_seed(0)) + 0.5
    out = cpu_kernels.silu_mul(torch.cat([gate, up]).view(1, -1))[0].double()
    expected = gate.double() * torch.sigmoid(gate.double()) * up.double()
    normal = expected.abs() >= TINY
    assert ((out - expected).abs() <= 1e-6 * expected.abs())[normal].all()
    assert ((out - expected).abs() <= 4 * 2.0**-149)[~normal].all()
    special = torch.tensor([[float("nan"), 1.0, float("inf"), -5.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]])
    silu_special = cpu_kernels.silu_mul(special)[0]
    assert silu_special[0].isnan() and silu_special[2] == float("inf")


# ---- rotary, KV write and decode attention ------------------------------------------------------


CACHE_DTYPES = [torch.float32, torch.bfloat16]


def _pool(
    kv_heads: int, head_dim: int, num_blocks: int, seed: int, dtype: torch.dtype = torch.float32
) -> KVCache:
    cache = KVCache(
        KVCacheSpec(1, kv_heads, head_dim, BLOCK, dtype),
        num_blocks,
        torch.device("cpu"),
        cache_line_bytes=64,
        cache_num_sets=64,
        skew=True,  # strided blocks: the kernels must honour the pool's block stride
    )
    generator = torch.Generator().manual_seed(seed)
    for pool in (*cache.k_blocks, *cache.v_blocks):
        pool.copy_(torch.randn(pool.shape, generator=generator))
    return cache


def _qkv_views(tokens: int, heads: int, kv_heads: int, head_dim: int, seed: int):
    """q, k, v as the decoder makes them: views into one fused qkv row per token (row stride
    (heads + 2 kv_heads) · head_dim, not heads · head_dim)."""
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator) * 2
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return (
        q.view(tokens, heads, head_dim),
        k.view(tokens, kv_heads, head_dim),
        v.view(tokens, kv_heads, head_dim),
    )


def _cos_sin(head_dim: int, positions: list[int]):
    rotary = RotaryEmbedding(head_dim, RopeConfig(theta=10000.0), max(positions) + 1)
    return rotary.lookup(torch.tensor(positions), torch.float32)  # [T, 1, D] each


def _random_tables(lengths, num_blocks: int, seed: int) -> list[list[int]]:
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, used = [], 0
    for length in lengths:
        count = -(-length // BLOCK)
        tables.append(order[used : used + count])
        used += count
    return tables


def _check_decode_attention(
    heads, head_dim, lengths, window, threads, seed=0, cache_dtype=torch.float32, tables=None
):
    """The kernel against apply_rotary + the runtime's paged path (scatter, gather, FP32 SDPA):
    the same pool contents bit for bit, the same attention within the bound."""
    num_heads, kv_heads = heads
    num_blocks = sum(-(-n // BLOCK) for n in lengths) + 3
    cache = _pool(kv_heads, head_dim, num_blocks, seed, cache_dtype)
    tables = tables or _random_tables(lengths, num_blocks, seed)
    q, k, v = _qkv_views(len(lengths), num_heads, kv_heads, head_dim, seed + 1)
    cos, sin = _cos_sin(head_dim, [n - 1 for n in lengths])
    meta = build_attention_metadata(
        [1] * len(lengths), list(lengths), tables, BLOCK, torch.device("cpu"), sliding_window=window or None
    )
    scale = head_dim**-0.5
    theirs_k, theirs_v = cache.k_blocks[0].clone(), cache.v_blocks[0].clone()
    qr, kr = apply_rotary(q, k, (cos, sin))
    expected = paged_attention(qr, kr, v, theirs_k, theirs_v, meta, scale)
    with _threads(threads):
        out = cpu_kernels.decode_attention(
            q, k, v, cos.view(-1, head_dim), sin.view(-1, head_dim), cache.k_blocks[0], cache.v_blocks[0],
            meta.block_tables, meta.context_lens, scale, window,
        )  # fmt: skip
    assert torch.equal(cache.k_blocks[0], theirs_k) and torch.equal(cache.v_blocks[0], theirs_v)
    # A convex combination of V rows: errors scale with the largest |V| the sequence reads.
    v_scale = max(theirs_v.abs().max().item(), 1.0)
    assert out.shape == expected.shape and out.dtype == torch.float32
    error = (out - expected).abs()
    assert (error <= REL * (expected.abs() + v_scale)).all(), error.max()


# head_dim 64 and 128: whole vectors, rotary halves of whole vectors; 40: whole vectors, rotary
# halves that are not (20); 36: a 4-lane row tail in scores, P·V and the output (masked loads).
# (heads, KV heads): GQA groups of 3 (SmolLM2), 1, 4 and 5 (head tiles of 3 and 1, of 3 and 2:
# scores and P·V take up to 3 heads of a KV head at once). One thread for
# the grid (a second changes only which thread runs a sequence; on a busy machine every parallel
# call can wait a scheduler slice for it), two for a few cases and for the split test below.
DECODE_CASES = [
    *(
        (head_dim, heads, window, 1)
        for head_dim in (64, 128, 40, 36)
        for heads in ((9, 3), (4, 4), (8, 2), (10, 2))
        for window in (0, 9)
    ),
    (64, (9, 3), 9, 2),
    (36, (8, 2), 0, 2),
]


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("head_dim,heads,window,threads", DECODE_CASES)
def test_decode_attention_matches_rotary_and_the_fp32_paged_sdpa_path(
    head_dim, heads, window, threads, cache_dtype
):
    # Lengths 1 (only itself), then 17, 40 and 100: not multiples of the block size.
    _check_decode_attention(
        heads, head_dim, (1, 17, 40, 100), window, threads, head_dim + window, cache_dtype
    )


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("window", [0, 130])
@pytest.mark.parametrize("lengths", [(300,), (300, 70), (257, 33, 129, 2, 64, 65, 200, 16)])
def test_decode_attention_merges_long_contexts_split_across_threads(window, lengths, cache_dtype):
    # With 2 threads one 300-key sequence is split in two at a part boundary (keys 0-127 and
    # 128-299; in the window, 170-255 and 256-299), two or eight sequences not at all: the partial
    # softmaxes must merge into the unsplit attention.
    _check_decode_attention((9, 3), 64, lengths, window, 2, len(lengths), cache_dtype)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("window", [0, 130, 400])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("length", [254, 300])
def test_decode_attention_shares_keys_between_rows_of_one_sequence(window, threads, length, cache_dtype):
    # A decode row and its drafts run as one-token sequences at consecutive positions over one
    # block table (rows 0-3 and 5-6); the kernel reads their common keys once for all of them
    # (where no window cuts into them). Row 4 has the next length but another table: it must not
    # join row 3's group. Each row's attention must still be its own (the torch path), and the
    # same bits as the kernel gives it alone on one thread: 254-258 keys cross a part boundary
    # (256), a window of 130 starts a row's keys between chunk boundaries.
    lengths = (length, length + 1, length + 2, length + 3, length + 4, 70, 71)
    own = _random_tables((length + 4, length + 4, 71), sum(-(-n // BLOCK) for n in lengths) + 3, 5)
    tables = [own[0]] * 4 + [own[1]] + [own[2]] * 2
    _check_decode_attention((9, 3), 64, lengths, window, threads, 7, cache_dtype, tables=tables)
    _check_rows_alone((9, 3), 64, lengths, tables, window, threads, cache_dtype)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("heads,head_dim,rows", [((9, 3), 64, 4), ((10, 2), 64, 2), ((8, 2), 36, 3)])
@pytest.mark.parametrize("length", [7, 254, 510, 1020])
@pytest.mark.parametrize("threads", [1, 3])
def test_decode_attention_gives_a_row_with_drafts_the_bits_it_has_alone(
    heads, head_dim, rows, length, threads, cache_dtype
):
    # A decode row and its drafts share a task, whose query heads of a KV head are scored and
    # weighed in tiles that mix the rows' heads (12 heads per KV head in 4 tiles, 10 in 3 + 3 + 3
    # + 1, 12 with a row tail), each row masking the drafts' keys after its own; a row alone is a
    # task of its own, split across threads differently (or not at all). Every row's attention must
    # be the same bits either way, or a draft's verification would not see what decoding without
    # drafts sees, and greedy outputs with speculation would drift from those without. The drafts'
    # keys cross no part boundary, the parts of 128 keys (256), their end (512) and the parts of
    # 256 (1024). Three threads split the drafts' sequence (a second sequence of 90 keys takes one
    # task).
    lengths = [length + r for r in range(rows)] + [90]
    own = _random_tables((lengths[rows - 1], 90), -(-lengths[rows - 1] // BLOCK) + 9, 3)
    _check_rows_alone(heads, head_dim, lengths, [own[0]] * rows + [own[1]], 0, threads, cache_dtype)


def _check_rows_alone(heads, head_dim, lengths, tables, window, threads, cache_dtype) -> None:
    """Every row's attention in one call on `threads` threads is the same bits as in a call of its
    own on one thread."""
    num_heads, kv_heads = heads
    batch = len(lengths)
    cache = _pool(kv_heads, head_dim, max(max(t) for t in tables) + 1, 11, cache_dtype)
    q, k, v = _qkv_views(batch, num_heads, kv_heads, head_dim, 12)
    cos, sin = (t.view(-1, head_dim) for t in _cos_sin(head_dim, [n - 1 for n in lengths]))
    meta = build_attention_metadata([1] * batch, list(lengths), tables, BLOCK, torch.device("cpu"))
    inputs = (q, k, v, cos, sin)
    together = attend_rows(inputs, cache, meta, slice(0, batch), head_dim**-0.5, window, threads)
    assert_each_row_as_alone(inputs, cache, meta, together, batch, head_dim**-0.5, window)


def test_decode_attention_spreads_a_nan_only_to_the_heads_that_read_it():
    # A NaN key gives NaN scores, softmax and output for the query heads of its KV head (as SDPA
    # does); other KV heads and other sequences are untouched.
    heads, kv_heads, head_dim, lengths = 6, 3, 64, (40, 40)
    cache = _pool(kv_heads, head_dim, 8, 0)
    tables = [[0, 1, 2], [3, 4, 5]]
    cache.k_blocks[0][1, 3, 1, 7] = float("nan")  # sequence 0, position 19, KV head 1
    q, k, v = _qkv_views(2, heads, kv_heads, head_dim, 1)
    cos, sin = _cos_sin(head_dim, [39, 39])
    meta = build_attention_metadata([1, 1], list(lengths), tables, BLOCK, torch.device("cpu"))
    out = cpu_kernels.decode_attention(
        q, k, v, cos.view(-1, head_dim), sin.view(-1, head_dim), cache.k_blocks[0], cache.v_blocks[0],
        meta.block_tables, meta.context_lens, 0.125, 0,
    ).view(2, heads, head_dim)  # fmt: skip
    assert out[0, 2:4].isnan().all()
    assert out[0, :2].isfinite().all() and out[0, 4:].isfinite().all() and out[1].isfinite().all()


@pytest.mark.parametrize("length", [40, 129])  # the drafts' keys in the first or in a new segment
def test_decode_attention_keeps_a_drafts_nan_value_from_the_rows_before_it(length):
    # A decode row and two drafts share a task whose last keys are the drafts' own; the second
    # draft's new value row is NaN. Rows 0 and 1 never read that key and must stay finite, the
    # bits they have alone (not even multiplied by a probability of 0: 0 · NaN is NaN).
    heads, kv_heads, head_dim = 6, 3, 64
    lengths = [length, length + 1, length + 2]
    table = _random_tables([length + 2], 12, 4)[0]
    cache = _pool(kv_heads, head_dim, 12, 0)
    q, k, v = _qkv_views(3, heads, kv_heads, head_dim, 1)
    v[2, 1, 5] = float("nan")
    cos, sin = (t.view(-1, head_dim) for t in _cos_sin(head_dim, [n - 1 for n in lengths]))
    meta = build_attention_metadata([1] * 3, lengths, [table] * 3, BLOCK, torch.device("cpu"))
    out = attend_rows((q, k, v, cos, sin), cache, meta, slice(0, 3), 0.125)
    assert out[:2].isfinite().all() and out[2].view(heads, head_dim)[2:4].isnan().any()
    assert_each_row_as_alone((q, k, v, cos, sin), cache, meta, out, 2, 0.125)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("head_dim", [64, 40, 36])  # vector rotary; rotate-half through scratch; a row tail
def test_rotary_kv_write_matches_apply_rotary_and_the_scatter_bit_for_bit(head_dim, cache_dtype):
    lengths, contexts = (5, 23), (9, 23)  # 5 new tokens after 4 cached ones, a fresh prompt of 23
    cache = _pool(2, head_dim, 6, head_dim, cache_dtype)
    tables = _random_tables(contexts, 6, head_dim)
    q, k, v = _qkv_views(sum(lengths), 6, 2, head_dim, head_dim)
    meta = build_attention_metadata(list(lengths), list(contexts), tables, BLOCK, torch.device("cpu"))
    cos, sin = _cos_sin(head_dim, [*range(4, 9), *range(23)])
    theirs_k, theirs_v = cache.k_blocks[0].clone(), cache.v_blocks[0].clone()
    qr, kr = apply_rotary(q, k, (cos, sin))
    theirs_k[meta.slot_block_ids, meta.slot_offsets] = kr.to(cache_dtype)
    theirs_v[meta.slot_block_ids, meta.slot_offsets] = v.to(cache_dtype)
    q_out, k_out = cpu_kernels.rotary_kv_write(
        q, k, v, cos.view(-1, head_dim), sin.view(-1, head_dim), cache.k_blocks[0], cache.v_blocks[0],
        meta.slot_block_ids, meta.slot_offsets,
    )  # fmt: skip
    assert q_out.is_contiguous() and k_out.is_contiguous()
    assert torch.equal(q_out, qr) and torch.equal(k_out, kr)
    assert torch.equal(cache.k_blocks[0], theirs_k) and torch.equal(cache.v_blocks[0], theirs_v)


def test_a_bf16_cache_rounds_to_nearest_even_as_torch_does_in_vectors_and_tails():
    # V is stored unrotated, so special values pass straight through the narrowing: ties to even
    # (down and up), the largest finite FP32 (rounds to inf), ±inf, -0, subnormals, the smallest
    # normal, NaN; head_dim 36 puts them in the 8-lane vectors (0-31) and the scalar tail (32-35).
    head_dim, kv_heads = 36, 1
    cache = _pool(kv_heads, head_dim, 2, 0, torch.bfloat16)
    q, k, v = _qkv_views(1, 1, kv_heads, head_dim, 0)
    special = torch.tensor(
        [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.4028235e38, -3.4028235e38, float("inf"), float("-inf"), -0.0,
         1e-40, -1e-45, TINY, float("nan"), 65504.0, 1 / 3, 2**-133, 0.1]
    )  # fmt: skip
    row = torch.cat([special, torch.randn(4), special[4:], special[:4]])
    v[0, 0] = row
    cos, sin = (t.view(-1, head_dim) for t in _cos_sin(head_dim, [0]))
    cpu_kernels.rotary_kv_write(
        q, k, v, cos, sin, *cache.k_blocks, *cache.v_blocks, torch.tensor([1]), torch.tensor([3])
    )
    stored, expected = cache.v_blocks[0][1, 3, 0], row.to(torch.bfloat16)
    nan = row.isnan()
    assert nan.sum() == 2 and stored[nan].isnan().all()  # a NaN stays a NaN (its payload is c10's)
    assert torch.equal(stored[~nan].view(torch.int16), expected[~nan].view(torch.int16))


# ---- bad inputs: a clear RuntimeError, and nothing written --------------------------------------


def _decode_inputs(length: int = 17, head_dim: int = 32):
    cache = _pool(2, head_dim, 4, 0)
    q, k, v = _qkv_views(1, 6, 2, head_dim, 0)
    cos, sin = (t.view(-1, head_dim) for t in _cos_sin(head_dim, [length - 1]))
    return cache, q, k, v, cos, sin


def _unchanged(cache: KVCache):
    before = cache.k_blocks[0].clone(), cache.v_blocks[0].clone()
    return lambda: torch.equal(cache.k_blocks[0], before[0]) and torch.equal(cache.v_blocks[0], before[1])


def test_decode_attention_rejects_a_block_outside_the_pool_before_writing():
    cache, q, k, v, cos, sin = _decode_inputs()
    unchanged = _unchanged(cache)
    tables, lengths = torch.tensor([[1, 99]]), torch.tensor([17])  # the new token's block is out of range
    with pytest.raises(RuntimeError, match="block id 99 out of range"):
        cpu_kernels.decode_attention(
            q, k, v, cos, sin, *cache.k_blocks, *cache.v_blocks, tables, lengths, 0.1, 0
        )
    with pytest.raises(RuntimeError, match="does not fit its block table"):
        cpu_kernels.decode_attention(
            q, k, v, cos, sin, *cache.k_blocks, *cache.v_blocks, tables[:, :1], lengths, 0.1, 0
        )
    assert unchanged()


def test_decode_attention_rejects_other_dtypes_and_shapes():
    cache, q, k, v, cos, sin = _decode_inputs()
    unchanged = _unchanged(cache)
    tables, lengths = torch.tensor([[1, 2]]), torch.tensor([17])
    with pytest.raises(RuntimeError, match="k_blocks must be float32 or bfloat16"):
        cpu_kernels.decode_attention(
            q, k, v, cos, sin, cache.k_blocks[0].half(), *cache.v_blocks, tables, lengths, 0.1, 0
        )
    with pytest.raises(
        RuntimeError, match=r"k_blocks \(BFloat16\) and v_blocks \(Float\) must have one dtype"
    ):
        cpu_kernels.decode_attention(
            q, k, v, cos, sin, cache.k_blocks[0].bfloat16(), *cache.v_blocks, tables, lengths, 0.1, 0
        )
    with pytest.raises(RuntimeError, match="q must be float32"):
        _avx2_ops().decode_attention(
            q.bfloat16(), k, v, cos, sin, *cache.k_blocks, *cache.v_blocks, tables, lengths, 0.1, 0
        )
    with pytest.raises(RuntimeError, match="int64"):
        cpu_kernels.decode_attention(
            q, k, v, cos, sin, *cache.k_blocks, *cache.v_blocks, tables.int(), lengths, 0.1, 0
        )
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        cpu_kernels.decode_attention(
            q[:, :5], k, v, cos, sin, *cache.k_blocks, *cache.v_blocks, tables, lengths, 0.1, 0
        )
    with pytest.raises(RuntimeError, match="at least one sequence"):
        cpu_kernels.decode_attention(
            q[:0],
            k[:0],
            v[:0],
            cos[:0],
            sin[:0],
            *cache.k_blocks,
            *cache.v_blocks,
            tables[:0],
            lengths[:0],
            0.1,
            0,
        )
    assert unchanged()


def test_rotary_kv_write_checks_every_slot_before_writing_any():
    cache, q, k, v, cos, sin = _decode_inputs()
    q, k, v = (t.expand(3, -1, -1) for t in (q, k, v))  # three tokens (rows may repeat: not written to)
    cos, sin = cos.expand(3, -1).contiguous(), sin.expand(3, -1).contiguous()
    unchanged = _unchanged(cache)
    good_blocks, good_offsets = torch.tensor([0, 1, 2]), torch.tensor([0, 5, 15])
    with pytest.raises(RuntimeError, match="block id 4 out of range"):  # the last token's
        cpu_kernels.rotary_kv_write(
            q, k, v, cos, sin, *cache.k_blocks, *cache.v_blocks, torch.tensor([0, 1, 4]), good_offsets
        )
    with pytest.raises(RuntimeError, match="slot offset 16 out of range"):
        cpu_kernels.rotary_kv_write(
            q, k, v, cos, sin, *cache.k_blocks, *cache.v_blocks, good_blocks, torch.tensor([0, 5, 16])
        )
    with pytest.raises(RuntimeError, match="v_blocks must be float32 or bfloat16"):
        cpu_kernels.rotary_kv_write(
            q, k, v, cos, sin, *cache.k_blocks, cache.v_blocks[0].half(), good_blocks, good_offsets
        )
    with pytest.raises(RuntimeError, match="must have one dtype"):
        cpu_kernels.rotary_kv_write(
            q, k, v, cos, sin, *cache.k_blocks, cache.v_blocks[0].bfloat16(), good_blocks, good_offsets
        )
    assert unchanged()


def test_norms_and_silu_reject_other_dtypes():
    x, w = torch.randn(2, 8), torch.randn(8)
    with pytest.raises(RuntimeError, match="w must be float32"):
        cpu_kernels.rms_norm(x, w.bfloat16(), 1e-6)
    with pytest.raises(RuntimeError, match="x must be float32"):
        _avx2_ops().rms_norm(x.bfloat16(), w, 1e-6)
    with pytest.raises(RuntimeError, match="delta must be float32"):
        cpu_kernels.add_rms_norm(x, x.double(), w, 1e-6)
    with pytest.raises(RuntimeError, match="gate_up must be float32"):
        _avx2_ops().silu_mul(x.bfloat16())
    with pytest.raises(RuntimeError, match=r"contiguous \[T, 2 \* I\]"):
        cpu_kernels.silu_mul(torch.randn(2, 7))


# ---- argmax ---------------------------------------------------------------------------------------


def _argmaxes():
    cpu_kernels.load(torch.float32)
    return [cpu_kernels.argmax_rows, _avx2_ops().argmax_rows]  # the best tier loaded, and AVX2's own


@pytest.mark.parametrize(
    "vocab", [1, 7, 8, 31, 32, 33, 100, 49152, 100003]
)  # around the 8- and 32-wide steps
def test_argmax_rows_matches_torch_argmax(vocab):
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=generator)
    logits[1] = logits[1].round()  # many ties: the first index of the maximum wins
    logits[2] = -float("inf")  # nothing finite: index 0
    logits[3, vocab // 2 :] = float("nan")  # the first NaN wins
    logits[4, -1] = float("nan")  # a NaN in the last, partial vector
    logits[5, vocab // 3] = float("inf")
    for argmax in _argmaxes():
        assert torch.equal(argmax(logits), torch.argmax(logits, dim=-1))


def test_argmax_rows_ties_across_lanes_vectors_and_passes_keep_the_first_index():
    logits = torch.zeros(5, 70)
    logits[0, [37, 5, 21]] = 2.0  # the same maximum in three vectors, in three accumulators' lanes
    logits[1, [69, 9]] = 1.0  # one of them in the tail
    logits[2, 69] = float("nan")
    logits[2, 3] = float("inf")
    logits[3] = -1.0
    logits[3, [4, 40]] = torch.tensor([-0.0, 0.0])  # -0 and +0 are equal: the first
    logits[4] = -float("inf")
    logits[4, 66] = -1e38
    for argmax in _argmaxes():
        assert argmax(logits).tolist() == [5, 9, 69, 4, 66] == torch.argmax(logits, dim=-1).tolist()


def test_argmax_rows_rejects_what_it_cannot_read():
    for argmax in _argmaxes():
        with pytest.raises(RuntimeError, match="contiguous FP32"):
            argmax(torch.zeros(2, 8, dtype=torch.bfloat16))
        with pytest.raises(RuntimeError, match="contiguous FP32"):
            argmax(torch.zeros(8, 2).t())

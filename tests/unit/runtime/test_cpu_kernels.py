"""Our AVX-512 tier (BF16 activations) against FP32 references, and how layers pick the kernels."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kunlun_runtime.errors import ConfigError
from kunlun_runtime.layers import cpu_kernels
from kunlun_runtime.layers.linear import (
    Int8Linear,
    NativeLinear,
    choose_linear_backend,
    onednn_bf16_reason,
    quantize_per_channel_int8,
)
from kunlun_runtime.platforms.cpu_features import IsaTier, cpu_capabilities
from tests.support.decode_attention_rows import assert_each_row_as_alone, attend_rows
from tests.support.kernel_marks import needs_kernels

# (N, K): SmolLM2's shapes, and odd ones that leave row and column tails.
SHAPES = [(960, 576), (576, 1536), (577, 33), (5, 7), (13, 100)]
BF16_REL = 2**-7  # one rounding of the output to BF16, plus FP32 accumulation-order noise


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    bound = BF16_REL * expected.abs() + 1e-3 * expected.abs().max()
    assert ((actual.float() - expected).abs() <= bound).all(), (actual.float() - expected).abs().max()


@needs_kernels(torch.bfloat16)
@pytest.mark.parametrize("rows", [*range(1, 17), 20, 24, 32, 37, 70])  # above 32: passes of 32 rows
def test_bf16_kernel_matches_fp32_reference(rows):
    generator = torch.Generator().manual_seed(rows)
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=generator).bfloat16()
        x = torch.randn(rows, k, generator=generator).bfloat16()
        bias = torch.randn(n, generator=generator)
        _close(cpu_kernels.linear_bf16(x, w, bias), x.float() @ w.float().T + bias)
        _close(cpu_kernels.linear_bf16(x, w, None), x.float() @ w.float().T)


@needs_kernels(torch.bfloat16)
@pytest.mark.parametrize("rows", [2, 3, 4, 5, 6, 8, 9, 12, 16, 21, 27, 32])
def test_bf16_kernel_gives_each_row_the_bits_it_has_alone(rows):
    # A decode row and its speculative drafts run as one batch: greedy decoding stays exact only
    # if a row's output does not depend on how many rows share its step (blocks of 1-8 rows and of
    # 9-32, in groups of 8, sum their lanes in the same order, one output at a time or sixteen).
    if cpu_capabilities().tier is IsaTier.AMX:
        pytest.skip("AMX runs 3-16 rows as tiles, in another summation order than one row")
    generator = torch.Generator().manual_seed(300 + rows)
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=generator).bfloat16()
        x = torch.randn(rows, k, generator=generator).bfloat16()
        for bias in (torch.randn(n, generator=generator), None):
            batch = cpu_kernels.linear_bf16(x, w, bias)
            for row in range(rows):
                alone = cpu_kernels.linear_bf16(x[row : row + 1].contiguous(), w, bias)[0]
                assert torch.equal(batch[row].view(torch.int16), alone.view(torch.int16))


@needs_kernels(torch.bfloat16)
@pytest.mark.parametrize("rows", [1, 3, 8, 11])
def test_int8_kernel_matches_dequantized_fp32_reference(rows):
    generator = torch.Generator().manual_seed(100 + rows)
    for n, k in SHAPES:
        q, scales = quantize_per_channel_int8(torch.randn(n, k, generator=generator))
        x = torch.randn(rows, k, generator=generator).bfloat16()
        bias = torch.randn(n, generator=generator)
        expected = x.float() @ (q.float() * scales[:, None]).T + bias
        _close(cpu_kernels.linear_int8(x, q, scales, bias), expected)


@needs_kernels(torch.bfloat16)
def test_int8_kernel_accumulates_long_rows_without_overflow():
    # 8,200 products of the largest activations and -128 weights: one INT32 sum would overflow.
    generator = torch.Generator().manual_seed(7)
    q = torch.full((16, 8200), -128, dtype=torch.int8)
    q[1::2] = torch.randint(-127, 128, (8, 8200), generator=generator, dtype=torch.int8)
    scales = torch.rand(16, generator=generator) + 0.5
    x = torch.full((2, 8200), 3.0).bfloat16()
    x[1] = torch.randn(8200, generator=generator).bfloat16()
    expected = x.float() @ (q.float() * scales[:, None]).T
    _close(cpu_kernels.linear_int8(x, q, scales, None), expected)


def _int16_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """x after the kernel's activation quantization: INT16 with one scale per ``block`` elements."""
    out = torch.empty_like(x, dtype=torch.float64)
    for start in range(0, x.shape[1], block):
        part = x[:, start : start + block].double()
        scale = part.abs().amax(dim=1, keepdim=True) / 32767
        out[:, start : start + block] = torch.round(part / scale) * scale
    return out


@needs_kernels(torch.bfloat16)
def test_int8_kernel_quantizes_activations_per_block_so_an_outlier_spoils_only_its_block():
    # An attention-sink-like row: one activation of 3000 among values of ~0.05. The kernel must
    # equal the per-256-block INT16 scheme exactly up to FP32 summation, and beat one scale per row.
    generator = torch.Generator().manual_seed(3)
    q = torch.randint(-127, 128, (64, 1536), generator=generator, dtype=torch.int8)
    q[:, 700] = 0  # the outlier's own product is exact in every scheme; what matters is its neighbours
    scales = torch.rand(64, generator=generator) + 0.5
    x = (torch.randn(1, 1536, generator=generator) * 0.05).bfloat16()
    x[0, 700] = 3000.0
    weight = q.double() * scales.double()[:, None]
    exact = x.double() @ weight.T
    blockwise = _int16_blocks(x, 256) @ weight.T
    rowwise = _int16_blocks(x, 1536) @ weight.T
    out = cpu_kernels.linear_int8(x, q, scales, None).double()
    assert ((out - blockwise).abs() <= 2**-8 * blockwise.abs() + 1e-6).all()  # its output's BF16 rounding
    assert (blockwise - exact).norm() < 0.5 * (rowwise - exact).norm()  # ~sqrt(256 / 1536) expected


@needs_kernels(torch.bfloat16)
def test_int8_kernel_turns_a_non_finite_row_into_nan_and_leaves_the_others():
    q, scales = quantize_per_channel_int8(torch.randn(32, 64))
    x = torch.randn(3, 64).bfloat16()
    x[1, 5], x[2, 9] = float("nan"), float("inf")
    out = cpu_kernels.linear_int8(x, q, scales, None)
    assert out[0].isfinite().all() and out[1:].isnan().all()
    _close(out[:1], x[:1].float() @ (q.float() * scales[:, None]).T)


def _cpu_vendor() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("vendor_id"):
            return line.split(":", 1)[1].strip()
    return ""


@pytest.fixture
def avx512_ops():
    """The AVX-512 tier's ops, its switches (weight prefetch order, BF16 dot products) put back as
    they were after the test."""
    ops = torch.ops.kunlun_avx512
    prefetch, dot = ops.weight_prefetch(), ops.bf16_dot()
    yield ops
    ops.set_weight_prefetch(prefetch)
    ops.set_bf16_dot(dot)


@needs_kernels(torch.bfloat16)
def test_weight_prefetch_order_follows_the_cpu_vendor(avx512_ops):
    # AMD cores (and Hygon's, derived from them) read the weight faster prefetched in address
    # order into L1; Intel keeps the per-row order into L2 it was tuned with
    # (benchmarks/bench_weight_prefetch.py).
    expected = "stream-l1" if _cpu_vendor() in ("AuthenticAMD", "HygonGenuine") else "rows-l2"
    assert avx512_ops.weight_prefetch() == expected


@needs_kernels(torch.bfloat16)
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 12, 32])
def test_both_weight_prefetch_orders_give_the_same_bits(avx512_ops, rows):
    # The order of prefetches must not change a result: both orders run the same arithmetic over
    # every row and column tail (on AMX CPUs 3-16 BF16 rows take the AMX kernel in both).
    generator = torch.Generator().manual_seed(700 + rows)
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=generator).bfloat16()
        x = torch.randn(rows, k, generator=generator).bfloat16()
        bias = torch.randn(n, generator=generator)
        q, scales = quantize_per_channel_int8(w.float())
        results = {}
        for policy in ("rows-l2", "stream-l1"):
            avx512_ops.set_weight_prefetch(policy)
            assert avx512_ops.weight_prefetch() == policy
            results[policy] = (
                cpu_kernels.linear_bf16(x, w, bias),
                cpu_kernels.linear_int8(x[: min(rows, 8)].contiguous(), q, scales, bias),
            )
        for ours, theirs in zip(results["rows-l2"], results["stream-l1"], strict=True):
            assert torch.equal(ours, theirs)


@needs_kernels(torch.bfloat16)
def test_an_unknown_weight_prefetch_order_is_rejected_and_changes_nothing(avx512_ops):
    before = avx512_ops.weight_prefetch()
    with pytest.raises(RuntimeError, match="must be 'stream-l1' or 'rows-l2', not 'l3'"):
        avx512_ops.set_weight_prefetch("l3")
    assert avx512_ops.weight_prefetch() == before


@needs_kernels(torch.bfloat16)
def test_kernels_reject_bad_inputs_with_a_message():
    w = torch.zeros(4, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="at least one row"):
        cpu_kernels.linear_bf16(torch.zeros(0, 8, dtype=torch.bfloat16), w, None)
    with pytest.raises(RuntimeError, match="columns"):
        cpu_kernels.linear_bf16(torch.zeros(1, 7, dtype=torch.bfloat16), w, None)
    with pytest.raises(RuntimeError, match="bfloat16"):  # FP32 activations are the AVX2 tier's
        torch.ops.kunlun_avx512.linear_bf16(torch.zeros(1, 8), w, None)
    with pytest.raises(RuntimeError, match="bias"):
        cpu_kernels.linear_bf16(torch.zeros(1, 8, dtype=torch.bfloat16), w, torch.zeros(3))


@needs_kernels(torch.bfloat16)
def test_native_linear_uses_the_kernel_for_decode_and_f_linear_for_prefill():
    linear = nn.Linear(64, 48, bias=True).to(torch.bfloat16).requires_grad_(False)
    native = NativeLinear(linear)
    assert native.weight is linear.weight  # shared: a tied lm_head is not copied
    prefill = torch.randn(9, 64).bfloat16()
    assert torch.equal(native(prefill), F.linear(prefill, linear.weight, linear.bias))
    decode = torch.randn(2, 64).bfloat16()
    _close(native(decode), decode.float() @ linear.weight.float().T + linear.bias.float())


@needs_kernels(torch.bfloat16)
def test_int8_linear_native_and_oneDNN_paths_agree():
    linear = nn.Linear(96, 40, bias=True).requires_grad_(False)
    int8 = Int8Linear.from_linear(linear)
    x = torch.randn(3, 96).bfloat16()
    reference = int8(x)  # _weight_int8pack_mm
    int8.native = True
    _close(int8(x), reference.float())


def test_auto_backend_is_native_only_for_bf16_weights_on_cpus_with_the_kernels():
    cpu = torch.device("cpu")
    assert choose_linear_backend("auto", torch.float32, cpu) == "plain"  # FP32 weights: oneDNN's SGEMM
    assert choose_linear_backend("plain", torch.bfloat16, cpu) == "plain"
    fallback = "prepacked" if onednn_bf16_reason() is None else "plain"  # oneDNN's BF16 path, where it runs
    expected = "native" if cpu_kernels.load(torch.bfloat16) else fallback
    assert choose_linear_backend("auto", torch.bfloat16, cpu) == expected


def test_explicit_native_backend_says_why_it_is_unavailable(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_build", lambda tier: "the CPU lacks avx512_bf16")
    with pytest.raises(ConfigError, match="avx512_bf16") as caught:
        choose_linear_backend("native", torch.bfloat16, torch.device("cpu"))
    assert caught.value.field == "linear_backend"
    fallback = "prepacked" if onednn_bf16_reason() is None else "plain"
    assert choose_linear_backend("auto", torch.bfloat16, torch.device("cpu")) == fallback


# ---- RMSNorm and fused decode attention: against the torch paths they replace -----------------


@needs_kernels(torch.bfloat16)
@pytest.mark.parametrize("rows,hidden", [(5, 96), (37, 100)])  # decode-sized; prefill-sized with a lane tail
def test_rms_norm_kernels_match_the_reference_norm(rows, hidden):
    from kunlun_runtime.layers.norm import RMSNorm

    norm = RMSNorm(hidden, 1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden))
    x, delta = torch.randn(rows, hidden).bfloat16() * 4, torch.randn(rows, hidden).bfloat16()
    reference = norm(x)  # native is off: F.rms_norm in FP32, as HF
    _close(cpu_kernels.rms_norm(x, norm.weight, norm.eps), reference.float())
    total, normed = cpu_kernels.add_rms_norm(x, delta, norm.weight, norm.eps)
    assert torch.equal(total, x + delta)  # the residual add rounds exactly as the eager add
    _close(normed, norm(x + delta).float())


@needs_kernels(torch.bfloat16)
@pytest.mark.parametrize("rows,inner", [(1, 1536), (37, 100)])
def test_silu_mul_matches_the_eager_roundings(rows, inner):
    gate_up = (torch.randn(rows, 2 * inner) * 4).bfloat16()
    gate, up = gate_up.split(inner, dim=-1)
    expected = F.silu(gate) * up  # eager BF16: silu rounded to BF16, then the product
    actual = cpu_kernels.silu_mul(gate_up)
    # Our exp differs from ATen's by an FP32 ulp or so: at most one BF16 step apart, mostly equal.
    _close(actual, expected.float())
    assert (actual == expected).float().mean() > 0.99


def _decode_case(window: int = 0, heads=(6, 2), head_dim=32, lengths=(1, 17, 40), tables=None, num_blocks=12):
    from kunlun_runtime.kv.cache import KVCache, KVCacheSpec
    from kunlun_runtime.layers.rotary import RopeConfig, RotaryEmbedding, apply_rotary

    num_heads, kv_heads = heads
    cache = KVCache(
        KVCacheSpec(1, kv_heads, head_dim, 16, torch.bfloat16),
        num_blocks,
        torch.device("cpu"),
        cache_line_bytes=64,
        cache_num_sets=64,
        skew=True,  # strided blocks: the kernel must honour the pool's block stride
    )
    generator = torch.Generator().manual_seed(window + head_dim)
    for pool in (*cache.k_blocks, *cache.v_blocks):
        pool.copy_(torch.randn(pool.shape, generator=generator))
    tables = tables or [[3, 7, 1], [5, 0, 9], [11, 2, 4]][: len(lengths)]
    batch = len(lengths)
    q = torch.randn(batch, num_heads, head_dim, generator=generator).bfloat16()
    k = torch.randn(batch, kv_heads, head_dim, generator=generator).bfloat16()
    v = torch.randn(batch, kv_heads, head_dim, generator=generator).bfloat16()
    rotary = RotaryEmbedding(head_dim, RopeConfig(theta=10000.0), max(64, *lengths))
    cos, sin = rotary.lookup(torch.tensor([n - 1 for n in lengths]), torch.bfloat16)
    return cache, tables, q, k, v, (cos, sin), apply_rotary


@needs_kernels(torch.bfloat16)
@pytest.mark.parametrize("window", [0, 9])
# head_dim 32/64/128 take the kernel's specialised widths, 48 the generic one and scalar rotary;
# (heads, KV heads) cover GQA groups of 3 and 1; one thread and two split the head tiles differently.
@pytest.mark.parametrize("heads,head_dim", [((6, 2), 32), ((9, 3), 64), ((4, 4), 128), ((6, 3), 48)])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_attention_matches_the_torch_paged_path(window, heads, head_dim, threads):
    _check_decode_attention(window, heads, head_dim, threads, lengths=(1, 17, 40))


@needs_kernels(torch.bfloat16)
@pytest.mark.parametrize("window", [0, 130])
@pytest.mark.parametrize("lengths", [(300,), (300, 70)])
def test_decode_attention_merges_long_contexts_split_across_threads(window, lengths):
    # With 2 threads one 300-key sequence is split in two at a part boundary (keys 0-127 and
    # 128-299; in the window, 170-255 and 256-299), two sequences not at all: the partial softmaxes
    # must merge into the same attention as the unsplit torch path.
    order = torch.randperm(40, generator=torch.Generator().manual_seed(1)).tolist()
    tables = [order[:19], order[19:24]][: len(lengths)]
    _check_decode_attention(window, (9, 3), 64, 2, lengths=lengths, tables=tables, num_blocks=40)


@needs_kernels(torch.bfloat16)
@pytest.mark.parametrize("window", [0, 130, 400])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("length", [254, 300])
def test_decode_attention_shares_keys_between_rows_of_one_sequence(window, threads, length):
    # A decode row and its drafts run as one-token sequences at consecutive positions over one
    # block table (rows 0-3 and 5-6); the kernel reads their common keys once for all of them
    # (where no window cuts into them). Row 4 has the next length but another table: its keys are
    # other blocks, so it must not join row 3's group. Each row's attention must be the same bits
    # as the kernel gives that row alone on one thread (which the tests above hold to the torch
    # path): 254-258 keys cross a part boundary (256), a window of 130 starts a row's keys between
    # chunk boundaries, and two or three threads split the rows' keys where one does not.
    order = torch.randperm(48, generator=torch.Generator().manual_seed(2)).tolist()
    long, other, short = order[:19], order[19:38], order[38:43]
    lengths = (length, length + 1, length + 2, length + 3, length + 4, 70, 71)
    _check_rows_alone(window, (9, 3), 64, threads, lengths, [long, long, long, long, other, short, short])


@needs_kernels(torch.bfloat16)
@pytest.mark.parametrize("heads,head_dim", [((6, 2), 32), ((9, 3), 64), ((4, 4), 128), ((6, 3), 48)])
@pytest.mark.parametrize("length", [7, 254, 510, 1020])
@pytest.mark.parametrize("rows", [4, 7])
@pytest.mark.parametrize("threads", [1, 3])
def test_decode_attention_scores_a_row_with_drafts_as_it_scores_it_alone(
    heads, head_dim, length, rows, threads
):
    # A decode row and its drafts (rows at consecutive positions over one table) share a task, all
    # their query heads over each chunk of keys at once, each row masking the drafts' keys after
    # its own; a row alone is a task of its own, split across threads differently (or not at all).
    # Every row's attention must be the same bits either way: a draft's verification then sees what
    # decoding without drafts would, and greedy outputs with speculation equal those without. The
    # AVX-512 kernel reduces the maxima and sums of 8 or more query heads per KV head 16 at a time
    # and of fewer one at a time: 4 and 7 rows of GQA groups of 3 give 12 and 21 heads (a second,
    # partial 16), a row alone 3. The drafts' keys cross no part boundary, the parts of 128 keys
    # (256), their end (512) and the parts of 256 (1024). Three threads split the drafts' sequence
    # (a second sequence of 40 keys takes one task).
    order = torch.randperm(70, generator=torch.Generator().manual_seed(3)).tolist()
    lengths = (*(length + r for r in range(rows)), 40)
    _check_rows_alone(0, heads, head_dim, threads, lengths, [order[:65]] * rows + [order[65:68]])


@needs_kernels(torch.bfloat16)
@pytest.mark.parametrize("length", [40, 63])  # the drafts' keys in the first chunk, or in the next
def test_decode_attention_keeps_a_drafts_nan_value_from_the_rows_before_it(length):
    # A decode row and two drafts share a task whose last keys are the drafts' own; the second
    # draft's new value row is NaN. Rows 0 and 1 never read that key and must stay finite, the
    # bits they have alone (not even multiplied by a probability of 0: 0 · NaN is NaN).
    from kunlun_runtime.layers.attention import build_attention_metadata

    lengths = (length, length + 1, length + 2)
    cache, tables, q, k, v, (cos, sin), _ = _decode_case(
        0, (6, 3), 64, lengths=lengths, tables=[[3, 7, 1, 5, 9]] * 3
    )
    v[2, 1, 5] = float("nan")
    meta = build_attention_metadata([1] * 3, list(lengths), tables, 16, torch.device("cpu"))
    cos, sin = cos.view(-1, 64), sin.view(-1, 64)
    out = attend_rows((q, k, v, cos, sin), cache, meta, slice(0, 3), 0.125)
    assert out[:2].isfinite().all() and out[2].view(6, 64)[2:4].isnan().any()
    assert_each_row_as_alone((q, k, v, cos, sin), cache, meta, out, 2, 0.125)


def _check_rows_alone(window, heads, head_dim, threads, lengths, tables) -> None:
    """Every row's attention in one call on `threads` threads is the same bits as in a call of its
    own on one thread. Bits, not closeness: an ulp's change in a score rarely shows through
    the BF16 probabilities and output, and a near-tie in the logits then picks another token."""
    from kunlun_runtime.layers.attention import build_attention_metadata

    cache, tables, q, k, v, (cos, sin), _ = _decode_case(
        window, heads, head_dim, lengths=lengths, tables=tables, num_blocks=max(max(t) for t in tables) + 1
    )
    meta = build_attention_metadata([1] * len(lengths), list(lengths), tables, 16, torch.device("cpu"))
    inputs = (q, k, v, cos.view(-1, head_dim), sin.view(-1, head_dim))
    together = attend_rows(inputs, cache, meta, slice(0, len(lengths)), 0.125, window, threads)
    assert_each_row_as_alone(inputs, cache, meta, together, len(lengths), 0.125, window)


@needs_kernels(torch.bfloat16)
@pytest.mark.parametrize("heads,head_dim", [((9, 3), 64), ((8, 1), 128), ((6, 3), 48), ((4, 2), 32)])
@pytest.mark.parametrize("rows", [1, 2, 6])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("spread", [1.0, 40.0])
def test_both_bf16_dot_products_give_decode_attention_the_same_bits(
    avx512_ops, heads, head_dim, rows, threads, spread
):
    # With "fma", a task of 6 or more query heads per KV head (a row with drafts; GQA groups of 3
    # from 2 rows on, of 8 alone) widens a chunk's K and V rows to FP32 and takes its scores and
    # P · V in FMAs, the odd element of each pair first as VDPBF16PS adds them: everything must be
    # VDPBF16PS's bits, over whole chunks and tails of keys, rows ending inside a chunk at odd and
    # even keys, masked head sizes (48) and full ones. Queries 40 times larger spread the scores
    # so far that most probabilities fall below FP32's normal range, where the BF16 conversion
    # VDPBF16PS's operands pass through flushes them to 0. A CPU whose VDPBF16PS rounds otherwise
    # refuses "fma" and keeps "dpbf16".
    from kunlun_runtime.layers.attention import build_attention_metadata

    try:
        avx512_ops.set_bf16_dot("fma")
    except RuntimeError as error:
        assert "rounds otherwise than FMAs" in str(error) and avx512_ops.bf16_dot() == "dpbf16"
        return
    order = torch.randperm(48, generator=torch.Generator().manual_seed(rows)).tolist()
    for length in (7, 70, 300):
        lengths = tuple(length + r for r in range(rows))
        case = {"lengths": lengths, "tables": [order[:20]] * rows, "num_blocks": 48}
        outputs = {}
        for method in ("fma", "dpbf16"):
            avx512_ops.set_bf16_dot(method)
            assert avx512_ops.bf16_dot() == method
            cache, tables, q, k, v, (cos, sin), _ = _decode_case(0, heads, head_dim, **case)
            q = (q.float() * spread).bfloat16()
            meta = build_attention_metadata([1] * rows, list(lengths), tables, 16, torch.device("cpu"))
            threads_before = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                outputs[method] = cpu_kernels.decode_attention(
                    q, k, v, cos.view(-1, head_dim), sin.view(-1, head_dim), cache.k_blocks[0],
                    cache.v_blocks[0], meta.block_tables, meta.context_lens, 0.125, 0,
                )  # fmt: skip
            finally:
                torch.set_num_threads(threads_before)
        assert outputs["fma"].isfinite().all()
        assert torch.equal(outputs["fma"], outputs["dpbf16"]), (length, rows)


@needs_kernels(torch.bfloat16)
def test_bf16_dot_products_are_chosen_once_and_an_unknown_choice_is_rejected(avx512_ops):
    # Probed at first use (both instructions' rates, and that the FMAs give VDPBF16PS's bits):
    # the same answer on every call after it, and a bad name changes nothing.
    default = avx512_ops.bf16_dot()
    assert default in ("fma", "dpbf16")
    assert avx512_ops.bf16_dot() == default
    with pytest.raises(RuntimeError, match="must be 'fma' or 'dpbf16', not 'amx'"):
        avx512_ops.set_bf16_dot("amx")
    assert avx512_ops.bf16_dot() == default


def _check_decode_attention(window, heads, head_dim, threads, **case) -> None:
    """The kernel against apply_rotary + the torch paged path: same cache contents, same output."""
    from kunlun_runtime.layers.attention import build_attention_metadata, paged_attention

    cache, tables, q, k, v, cos_sin, apply_rotary = _decode_case(window, heads, head_dim, **case)
    lengths = case["lengths"]
    meta = build_attention_metadata(
        [1] * len(lengths), list(lengths), tables, 16, torch.device("cpu"), sliding_window=window or None
    )
    theirs_k, theirs_v = cache.k_blocks[0].clone(), cache.v_blocks[0].clone()
    qr, kr = apply_rotary(q, k, cos_sin)
    expected = paged_attention(qr, kr, v, theirs_k, theirs_v, meta, 0.125)
    cos, sin = cos_sin
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_kernels.decode_attention(
            q, k, v, cos.view(-1, head_dim), sin.view(-1, head_dim), cache.k_blocks[0], cache.v_blocks[0],
            meta.block_tables, meta.context_lens, 0.125, window,
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads_before)
    assert torch.equal(cache.k_blocks[0], theirs_k) and torch.equal(cache.v_blocks[0], theirs_v)
    # The kernel weighs the values by probabilities rounded to BF16 (as HF's eager attention and
    # PyTorch's CPU flash attention do); the torch path keeps them in FP32. Each weight's rounding
    # (at most 2^-9 of it) moves the output by at most 2^-9 of sum_j p_j |v_j - out|: attention
    # over |V| bounds that, with the output's own share in BF16_REL.
    weighed = paged_attention(qr, kr, v.abs(), theirs_k, theirs_v.abs(), meta, 0.125).float()
    bound = BF16_REL * expected.float().abs() + 2**-8 * weighed + 1e-3 * expected.float().abs().max()
    assert ((out.float() - expected.float()).abs() <= bound).all(), (
        (out.float() - expected.float()).abs().max()
    )


@needs_kernels(torch.bfloat16)
def test_decode_attention_rejects_a_block_table_outside_the_pool():
    from kunlun_runtime.layers.attention import build_attention_metadata

    cache, _tables, q, k, v, (cos, sin), _ = _decode_case(lengths=(17,))
    meta = build_attention_metadata([1], [17], [[3, 99]], 16, torch.device("cpu"))
    before = cache.k_blocks[0].clone()
    with pytest.raises(RuntimeError, match="block id 99 out of range"):
        cpu_kernels.decode_attention(
            q, k, v, cos.view(-1, 32), sin.view(-1, 32), cache.k_blocks[0], cache.v_blocks[0],
            meta.block_tables, meta.context_lens, 0.125, 0,
        )  # fmt: skip
    assert torch.equal(cache.k_blocks[0], before)  # checked before anything is written


@needs_kernels(torch.bfloat16)
@pytest.mark.parametrize("head_dim", [64, 48])  # vector and scalar rotary
def test_rotary_kv_write_matches_apply_rotary_and_the_scatter_bit_for_bit(head_dim):
    from kunlun_runtime.layers.attention import build_attention_metadata
    from kunlun_runtime.layers.rotary import RopeConfig, RotaryEmbedding

    lengths = (5, 23)  # prefill chunks: 5 new tokens after 4 cached ones, and a fresh prompt of 23
    cache, tables, *_, apply_rotary = _decode_case(heads=(6, 2), head_dim=head_dim)
    generator = torch.Generator().manual_seed(head_dim)
    tokens = sum(lengths)
    q = torch.randn(tokens, 6, head_dim, generator=generator).bfloat16()
    k = torch.randn(tokens, 2, head_dim, generator=generator).bfloat16()
    v = torch.randn(tokens, 2, head_dim, generator=generator).bfloat16()
    meta = build_attention_metadata(list(lengths), [9, 23], tables[:2], 16, torch.device("cpu"))
    positions = torch.cat([torch.arange(4, 9), torch.arange(0, 23)])
    cos, sin = RotaryEmbedding(head_dim, RopeConfig(theta=10000.0), 64).lookup(positions, torch.bfloat16)
    theirs_k, theirs_v = cache.k_blocks[0].clone(), cache.v_blocks[0].clone()
    qr, kr = apply_rotary(q, k, (cos, sin))
    theirs_k[meta.slot_block_ids, meta.slot_offsets] = kr
    theirs_v[meta.slot_block_ids, meta.slot_offsets] = v
    q_out, k_out = cpu_kernels.rotary_kv_write(
        q, k, v, cos.view(-1, head_dim), sin.view(-1, head_dim), cache.k_blocks[0], cache.v_blocks[0],
        meta.slot_block_ids, meta.slot_offsets,
    )  # fmt: skip
    assert torch.equal(q_out, qr) and torch.equal(k_out, kr)
    assert torch.equal(cache.k_blocks[0], theirs_k) and torch.equal(cache.v_blocks[0], theirs_v)

    before = cache.k_blocks[0].clone()
    bad_blocks = meta.slot_block_ids.clone()
    bad_blocks[-1] = 99
    with pytest.raises(RuntimeError, match="block id 99 out of range"):
        cpu_kernels.rotary_kv_write(
            q, k, v, cos.view(-1, head_dim), sin.view(-1, head_dim), cache.k_blocks[0], cache.v_blocks[0],
            bad_blocks, meta.slot_offsets,
        )  # fmt: skip
    assert torch.equal(cache.k_blocks[0], before)  # checked before anything is written


@needs_kernels(torch.bfloat16)
def test_decode_attention_rejects_an_empty_batch():
    cache, _tables, q, k, v, (cos, sin), _ = _decode_case(lengths=(17,))
    empty = torch.zeros(0, dtype=torch.long)
    with pytest.raises(RuntimeError, match="at least one sequence"):
        cpu_kernels.decode_attention(
            q[:0], k[:0], v[:0], cos.view(-1, 32)[:0], sin.view(-1, 32)[:0], cache.k_blocks[0], cache.v_blocks[0],
            empty.view(0, 1), empty, 0.125, 0,
        )  # fmt: skip


@pytest.mark.parametrize("tier", [IsaTier.AVX512, IsaTier.AVX2])
def test_a_broken_prebuilt_library_is_reported_not_raised(monkeypatch, tmp_path, tier):
    library = tmp_path / f"{cpu_kernels.TIERS[tier].namespace}.so"
    library.write_bytes(b"not an ELF file")
    monkeypatch.setenv(cpu_kernels.PREBUILT_ENV, str(tmp_path))
    reason = cpu_kernels._build.__wrapped__(tier)  # uncached: the real load, with this environment
    assert reason is not None
    assert str(library) in reason or "tier" in reason  # a CPU below the tier stops earlier


@needs_kernels(torch.bfloat16)
def test_native_linear_accepts_a_non_contiguous_weight():
    linear = nn.Linear(64, 48, bias=False).to(torch.bfloat16).requires_grad_(False)
    linear.weight = nn.Parameter(
        torch.randn(64, 48).bfloat16().t(), requires_grad=False
    )  # a column slice's layout
    native = NativeLinear(linear)
    x = torch.randn(2, 64).bfloat16()
    _close(native(x), x.float() @ linear.weight.float().T)


@needs_kernels(torch.bfloat16)
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 49152, 100003])
def test_argmax_rows_matches_torch_argmax(vocab):
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=generator)
    logits[1] = logits[1].round()  # many ties: the first index of the maximum wins
    logits[2] = -float("inf")  # nothing finite: index 0
    logits[3, vocab // 2 :] = float("nan")  # a NaN wins, the first one
    assert torch.equal(cpu_kernels.argmax_rows(logits), torch.argmax(logits, dim=-1))


@needs_kernels(torch.bfloat16)
def test_argmax_rows_ties_across_lanes_and_chunks_keep_the_first_index():
    logits = torch.zeros(3, 70)
    logits[0, [5, 21, 37]] = 2.0  # the same maximum in three 16-wide chunks, three lanes
    logits[1, [40, 9]] = 1.0
    logits[2, 69] = float("nan")
    logits[2, 3] = float("inf")
    assert cpu_kernels.argmax_rows(logits).tolist() == [5, 9, 69] == torch.argmax(logits, dim=-1).tolist()


@needs_kernels(torch.bfloat16)
def test_argmax_rows_rejects_what_it_cannot_read():
    with pytest.raises(RuntimeError, match="contiguous FP32"):
        cpu_kernels.argmax_rows(torch.zeros(2, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="contiguous FP32"):
        cpu_kernels.argmax_rows(torch.zeros(8, 2).t())


@needs_kernels(torch.bfloat16)
def test_engines_on_our_kernels_pick_greedy_tokens_with_our_argmax_and_the_same_tokens(tmp_path):
    from kunlun_runtime import LLM, SamplingParams
    from kunlun_runtime.engine.sampler import Sampler
    from tests.support.tiny_models import TINY_SPECS, make_tiny_model

    model_dir = make_tiny_model(tmp_path / "tiny", TINY_SPECS["llama-gqa"])
    llm = LLM(str(model_dir), dtype="bfloat16", kv_cache_memory="16MiB")
    assert llm.engine.sampler.argmax is cpu_kernels.argmax_rows
    prompts = [{"prompt_token_ids": [3 + i, 40 + 2 * i, 7]} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ours = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    llm.engine.sampler = Sampler(llm.engine.eos_token_ids)  # torch.argmax
    llm.engine.block_pool.reset_prefix_cache()
    assert [out.outputs[0].token_ids for out in llm.generate(prompts, params)] == ours
    fp32 = LLM(str(model_dir), dtype="float32", kv_cache_memory="16MiB")
    assert fp32.engine.sampler.argmax is not cpu_kernels.argmax_rows  # no native kernels in FP32


def test_build_to_writes_the_tiers_without_loading_and_the_runtime_loads_them_from_there(
    tmp_path, monkeypatch
):
    # The image's build step: each tier's library, compiled without loading it; a process pointed
    # at the folder then loads the tiers its CPU runs from it. Here the tiers this host runs (their
    # libraries are built by the tests before, so this takes seconds): a tier above the host's,
    # compiled on a build host that cannot run it, is the image build's every time (runtime/Dockerfile
    # runs --build-to on the CI host), and tests/images checks that the image holds every tier.
    import os
    import subprocess
    import sys

    if cpu_kernels.unavailable_reason(torch.float32) and "tier" in cpu_kernels.unavailable_reason(
        torch.float32
    ):
        pytest.skip("not an x86-64 CPU with AVX2: nothing here could load what is built")
    runs_here = {tier: spec for tier, spec in cpu_kernels.TIERS.items() if cpu_capabilities().tier >= tier}
    monkeypatch.setattr(cpu_kernels, "TIERS", runs_here)
    assert cpu_kernels.main(["--build-to", str(tmp_path)]) == 0
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(
        f"{s.namespace}.so" for s in runs_here.values()
    )
    probe = "import torch; from kunlun_runtime.layers import cpu_kernels as k; print(k.load(torch.float32), k.load())"
    env = {
        **os.environ,
        cpu_kernels.PREBUILT_ENV: str(tmp_path),
        "TORCH_EXTENSIONS_DIR": str(tmp_path / "none"),
    }
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    avx2, avx512 = done.stdout.split()
    assert avx2 == "True" and avx512 == str(cpu_kernels.load(torch.bfloat16))
    assert not (tmp_path / "none").exists()  # loaded from the folder, nothing compiled

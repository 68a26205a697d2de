"""The AVX2 tier's linear kernels (csrc/avx2/linear_bf16.cpp, linear_int8.cpp: FP32 activations,
BF16 or INT8 weights) against float64 references: linear_bf16 is an FP32 matmul over the widened
weight, linear_int8 the W8A8 scheme (activations quantized per block of 32 to INT8, integer dot
products)."""

import pytest
import torch

from kunlun_runtime.layers import cpu_kernels
from kunlun_runtime.platforms.cpu_features import IsaTier
from tests.support.kernel_marks import needs_kernels

pytestmark = needs_kernels(torch.float32)

# (N, K): SmolLM2-135M's qkv and down projections, then shapes that leave tails: K below one
# vector, K and N not multiples of the kernels' steps (8 and 16 columns for BF16, 32 for INT8;
# 3-6 output channels per block), exactly one INT8 block.
SHAPES = [(960, 576), (576, 1536), (13, 100), (5, 7), (17, 33), (6, 32), (3, 1)]
# Decode batches, and larger ones that run as several row tiles (40 = 10 tiles of 4; 23 = 5 of 4
# and one of 3).
ROWS = [*range(1, 17), 23, 40]
U = 2.0**-24  # FP32 unit roundoff
BLOCK = 32  # activations per INT8 scale in linear_int8


def _bf16_bound(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Worst-case FP32 rounding of the kernel: each of the 8 lanes adds K/8 products by FMA (one
    rounding each), 3 adds sum the lanes, 1 adds the bias; an error of at most that many units
    of roundoff of the sum of absolute terms."""
    magnitude = x.double().abs() @ w.double().abs().T
    if bias is not None:
        magnitude = magnitude + bias.double().abs()
    return (x.shape[1] / 8 + 5) * U * magnitude


@pytest.mark.parametrize("rows", ROWS)
def test_bf16_linear_equals_the_fp32_product_up_to_accumulation_rounding(rows):
    torch.manual_seed(rows)
    for n, k in SHAPES:
        x = torch.randn(rows, k)
        w = torch.randn(n, k).bfloat16()
        bias = torch.randn(n)
        for b in (bias, None):
            out = cpu_kernels.linear_bf16(x, w, b)
            assert out.dtype == torch.float32 and out.shape == (rows, n)
            expected = x.double() @ w.double().T + (b.double() if b is not None else 0)
            assert ((out.double() - expected).abs() <= _bf16_bound(x, w, b)).all(), (n, k)


def test_bf16_linear_reads_nothing_past_a_weight_row():
    # Infinities right after each row's last column and after the end of w: the kernel pads the
    # tails of K with zeros, and inf · 0 would turn any stray read into NaN.
    torch.manual_seed(1)
    n, k = 13, 100
    storage = torch.full((n * k + 64,), float("inf")).bfloat16()
    w = storage[: n * k].view(n, k)
    w.copy_(torch.randn(n, k).bfloat16())
    w[4, 0] = float("inf")  # right after row 3's last column
    x = torch.randn(5, k)
    out = cpu_kernels.linear_bf16(x, w, None)
    assert not out[:, 4].isfinite().any()
    others = torch.cat([out[:, :4], out[:, 5:]], dim=1)
    assert others.isfinite().all()


# Run in a child process, so that a stray read faults there and fails the test instead of pytest.
# Each weight lies against an unreadable page: once starting right after one, once ending right
# before one; every tile kind reads it (1-5 and 8 rows), and the outputs match torch's.
_GUARDED_READS = """
import ctypes, mmap, torch
from kunlun_runtime.layers import cpu_kernels
assert cpu_kernels.load(torch.float32)
libc = ctypes.CDLL(None)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
page = mmap.PAGESIZE
def guarded(nbytes, at_end):
    region = mmap.mmap(-1, 3 * page)  # anonymous: page-aligned
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    for guard in (base, base + 2 * page):
        assert libc.mprotect(guard, page, 0) == 0  # PROT_NONE
    offset = page + (page - nbytes if at_end else 0)
    return region, offset
torch.manual_seed(0)
for n, k in [(13, 100), (5, 7), (17, 33), (6, 32), (4, 512), (3, 1)]:
    for at_end in (False, True):
        for dtype in (torch.bfloat16, torch.int8):
            size = torch.tensor([], dtype=dtype).element_size()
            region, offset = guarded(n * k * size, at_end)
            w = torch.frombuffer(region, dtype=dtype, count=n * k, offset=offset).view(n, k)
            source = torch.randn(n, k) if dtype == torch.bfloat16 else torch.randint(-127, 128, (n, k))
            w.copy_(source.to(dtype))
            for rows in (1, 2, 3, 4, 5, 8):
                x = torch.randn(rows, k)
                if dtype == torch.bfloat16:
                    out = cpu_kernels.linear_bf16(x, w, None)
                    assert torch.allclose(out, x @ w.float().T, rtol=1e-4, atol=1e-4), (n, k, rows)
                else:
                    scales = torch.full((n,), 0.01)
                    out = cpu_kernels.linear_int8(x, w, scales, None)
                    assert out.isfinite().all() and out.shape == (rows, n), (n, k, rows)
            del w
print("ok")
"""


def test_linear_kernels_read_nothing_before_or_after_a_weight():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _GUARDED_READS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])


def test_bf16_linear_turns_only_non_finite_rows_non_finite_and_zero_rows_into_the_bias():
    torch.manual_seed(2)
    x = torch.randn(4, 100)
    x[1, 7], x[2, 99] = float("nan"), float("-inf")
    x[3] = 0
    w = torch.randn(13, 100).bfloat16()
    bias = torch.randn(13)
    out = cpu_kernels.linear_bf16(x, w, bias)
    assert out[1].isnan().all() and not out[2].isfinite().any()
    assert torch.equal(out[3], bias)
    assert (
        (out[0].double() - (x[0].double() @ w.double().T + bias)).abs() <= _bf16_bound(x[:1], w, bias)
    ).all()


def _w8a8_reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
    """linear_int8's arithmetic in float64, and the bound on its FP32 rounding.

    Per row and block of 32 activations (the row padded with zeros): step = max|x| / 127 in FP32,
    x_q = round_half_even(x · (1 / step)) in FP32; a block with max|x| < 1e-30 is zeros. The block
    dot products x_q · q are exact integers; the kernel adds step · dot over the blocks in FP32
    lanes (one rounding per block), sums the lanes, then applies the weight scale and the bias.
    A row with a NaN or an infinity gives NaN."""
    rows, k = x.shape
    pad = -k % BLOCK
    xb = torch.nn.functional.pad(x, (0, pad)).view(rows, -1, BLOCK)
    qb = torch.nn.functional.pad(q, (0, pad)).view(q.shape[0], -1, BLOCK).double()
    largest = xb.abs().amax(dim=-1, keepdim=True)
    step = largest / 127
    xq = torch.round(xb * (torch.ones_like(step) / step)).clamp(-127, 127)
    tiny = largest < 1e-30
    xq = torch.where(tiny, torch.zeros_like(xq), xq).double()
    step = torch.where(tiny, torch.zeros_like(step), step).double().squeeze(-1)  # [rows, blocks]
    dots = torch.einsum("mbk,nbk->mnb", xq, qb)  # exact: integers below 2^53
    abs_dots = torch.einsum("mbk,nbk->mnb", xq.abs(), qb.abs())
    scale = scales.double()
    expected = (dots * step[:, None, :]).sum(-1) * scale
    magnitude = (abs_dots * step[:, None, :]).sum(-1) * scale.abs()
    if bias is not None:
        expected = expected + bias.double()
        magnitude = magnitude + bias.double().abs()
    blocks = xb.shape[1]
    bound = (blocks + 6) * U * magnitude
    expected[~x.isfinite().all(dim=1)] = float("nan")
    return expected, bound


def _int8_weights(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    q[0, : min(k, 5)] = 127
    q[-1, -min(k, 5) :] = -127  # the extremes the integer path must not saturate on
    return q, torch.rand(n) * 0.02 + 1e-3


@pytest.mark.parametrize("rows", ROWS)
def test_int8_linear_equals_the_blockwise_w8a8_reference_up_to_fp32_rounding(rows):
    torch.manual_seed(100 + rows)
    for n, k in SHAPES:
        x = torch.randn(rows, k) * 3
        q, scales = _int8_weights(n, k)
        bias = torch.randn(n)
        for b in (bias, None):
            out = cpu_kernels.linear_int8(x, q, scales, b)
            assert out.dtype == torch.float32 and out.shape == (rows, n)
            expected, bound = _w8a8_reference(x, q, scales, b)
            assert ((out.double() - expected).abs() <= bound).all(), (n, k)


def test_int8_linear_stays_within_half_a_quantization_step_of_the_float_activation_product():
    # Each activation moves by at most half its block's step, so each output by at most
    # Σ_blocks step / 2 · Σ |q| · scale (plus FP32 rounding, far smaller), and on Gaussian data
    # by well under 1 % overall.
    torch.manual_seed(3)
    x = torch.randn(8, 1536)
    x[:, ::97] *= 20  # scattered outliers coarsen only their own blocks
    q, scales = _int8_weights(576, 1536)
    out = cpu_kernels.linear_int8(x, q, scales, None).double()
    exact = x.double() @ (q.double() * scales.double()[:, None]).T
    step = x.view(8, -1, BLOCK).abs().amax(dim=-1).double() / 127
    weight_mass = q.double().abs().view(576, -1, BLOCK).sum(-1)  # [N, blocks]
    bound = 0.5 * (step @ weight_mass.T) * scales.double() * (1 + 1e-5)
    assert ((out - exact).abs() <= bound).all()
    assert (out - exact).norm() < 0.02 * exact.norm()


def test_int8_linear_turns_a_non_finite_row_into_nan_and_leaves_the_others():
    torch.manual_seed(4)
    x = torch.randn(5, 100)
    x[1, 3], x[2, 99], x[4, 50] = float("nan"), float("inf"), float("-inf")
    q, scales = _int8_weights(13, 100)
    bias = torch.randn(13)
    out = cpu_kernels.linear_int8(x, q, scales, bias)
    assert out[[1, 2, 4]].isnan().all()
    expected, bound = _w8a8_reference(x[[0, 3]], q, scales, bias)
    assert ((out[[0, 3]].double() - expected).abs() <= bound).all()


def test_int8_linear_gives_exactly_the_bias_for_zero_rows_and_ignores_zero_and_tiny_blocks():
    torch.manual_seed(5)
    q, scales = _int8_weights(13, 100)
    bias = torch.randn(13)
    x = torch.randn(3, 100)
    x[0] = 0
    x[1, :32] = 0  # an all-zero block among others
    x[2, 32:64] *= 1e-38  # max/127 would be subnormal, its reciprocal inf: below 1e-30 counts as zeros
    out = cpu_kernels.linear_int8(x, q, scales, bias)
    assert torch.equal(out[0], bias)
    expected, bound = _w8a8_reference(x, q, scales, bias)
    assert out.isfinite().all() and ((out.double() - expected).abs() <= bound).all()
    rest = x.clone()
    rest[2, 32:64] = 0
    assert torch.allclose(out[2], cpu_kernels.linear_int8(rest[2:], q, scales, bias)[0], rtol=1e-6, atol=1e-6)


def test_linear_kernels_reject_bad_inputs_with_a_message():
    w = torch.zeros(4, 8, dtype=torch.bfloat16)
    q, scales = torch.zeros(4, 8, dtype=torch.int8), torch.ones(4)
    x = torch.zeros(2, 8)
    # cpu_kernels routes BF16 activations to the AVX-512 tier, so the AVX2 ops are called directly
    # to see them refuse BF16 activations.
    avx2 = getattr(torch.ops, cpu_kernels.TIERS[IsaTier.AVX2].namespace)
    cases = [
        (lambda: avx2.linear_bf16(x.bfloat16(), w, None), "x must be float32"),
        (lambda: avx2.linear_int8(x.bfloat16(), q, scales, None), "x must be float32"),
        (lambda: cpu_kernels.linear_bf16(torch.zeros(8), w, None), "x must be 2-D"),
        (lambda: cpu_kernels.linear_bf16(torch.zeros(0, 8), w, None), "at least one row"),
        (lambda: cpu_kernels.linear_bf16(torch.zeros(2, 7), w, None), "x has 7 columns but w has 8"),
        (lambda: cpu_kernels.linear_bf16(torch.zeros(8, 2).T, w, None), "x must be contiguous"),
        (lambda: cpu_kernels.linear_bf16(x, w.float(), None), "w must be bfloat16"),
        (
            lambda: cpu_kernels.linear_bf16(x, torch.zeros(8, 4, dtype=torch.bfloat16).T, None),
            "w must be contiguous",
        ),
        (
            lambda: cpu_kernels.linear_bf16(x, w, torch.zeros(3)),
            "bias must be a contiguous float32 vector of 4",
        ),
        (lambda: cpu_kernels.linear_bf16(x, w, torch.zeros(4).bfloat16()), "bias must be"),
        (lambda: cpu_kernels.linear_int8(x, w, scales, None), "w must be int8"),
        (
            lambda: cpu_kernels.linear_int8(x, q, torch.ones(5), None),
            "scales must be a contiguous float32 vector of 4",
        ),
        (lambda: cpu_kernels.linear_int8(x, q, scales.double(), None), "scales must be"),
        (lambda: cpu_kernels.linear_int8(torch.zeros(2, 9), q, scales, None), "x has 9 columns but w has 8"),
        (lambda: cpu_kernels.linear_int8(x, q, scales, torch.zeros(5)), "bias must be"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()


@pytest.mark.parametrize(
    "switch,only,other,message",
    [
        ("weight_prefetch", "stream-l1", "rows-l2", "into L1 \\('stream-l1'\\) only, not 'rows-l2'"),
        # no VDPBF16PS here: BF16 is widened for FP32 FMAs everywhere
        ("bf16_dot", "fma", "dpbf16", "in FP32 FMAs \\('fma'\\) only, not 'dpbf16'"),
    ],
)
def test_the_tier_has_one_choice_of_each_switch_and_refuses_another(switch, only, other, message):
    ops = torch.ops.kunlun_avx2
    get, set_ = getattr(ops, switch), getattr(ops, f"set_{switch}")
    assert get() == only
    set_(only)
    with pytest.raises(RuntimeError, match=message):
        set_(other)
    assert get() == only

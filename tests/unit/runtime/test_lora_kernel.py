"""``lora_update`` (layers/csrc/decode_layers.cpp) of each kernel tier against a float64 reference:
odd widths and ranks that leave every vector and block tail, rows on different slots and on the
base model, one thread and several; and bad inputs refused with a message."""

import pytest
import torch

from kunlun_runtime.layers import cpu_kernels

TIERS = [torch.bfloat16, torch.float32]  # the AVX-512 tier's activations, the AVX2 tier's


def _tier(dtype):
    if not cpu_kernels.load(dtype):
        pytest.skip(str(cpu_kernels.unavailable_reason(dtype)))
    return dtype


def _reference(x, y, a, b, slots):
    out = y.double().clone()
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            out[row] += (x[row].double() @ a[slot].double().T) @ b[slot].double()
    return out


@pytest.mark.parametrize("dtype", TIERS, ids=["bf16", "fp32"])
@pytest.mark.parametrize(
    ("rows", "k", "w", "n", "slots"),
    [
        (1, 576, 48, 960, [2]),  # SmolLM2's qkv, one adapter
        (8, 1536, 16, 576, [0, 1, 2, 3, 0, 1, 2, 3]),  # down, four adapters
        (5, 100, 7, 333, [1, -1, 1, 0, -1]),  # every tail; base rows among them
        (3, 17, 40, 129, [-1, -1, -1]),  # nobody on an adapter: y unchanged
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_lora_update_matches_a_float64_reference(dtype, rows, k, w, n, slots, threads):
    _tier(dtype)
    generator = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=generator).to(dtype)
    y = torch.randn(rows, n, generator=generator).to(dtype)
    a = (torch.randn(4, w, k, generator=generator) * 0.1).to(dtype)
    b = (torch.randn(4, w, n, generator=generator) * 0.1).to(dtype)
    slot_tensor = torch.tensor(slots, dtype=torch.long)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_kernels.lora_update(x, y, a, b, slot_tensor)
    finally:
        torch.set_num_threads(previous)
    expected = _reference(x, y, a, b, slot_tensor)
    assert out.dtype == dtype and out.shape == (rows, n)
    # One rounding of the output (BF16: 2^-8 relative), plus FP32 accumulation noise.
    rel = 2**-8 if dtype == torch.bfloat16 else 1e-6
    bound = rel * expected.abs() + 1e-5 * expected.abs().max()
    assert ((out.double() - expected).abs() <= bound).all(), (out.double() - expected).abs().max()
    for row, slot in enumerate(slots):
        if slot < 0:
            assert torch.equal(out[row], y[row])  # a base row is y, bit for bit


@pytest.mark.parametrize("dtype", TIERS, ids=["bf16", "fp32"])
def test_a_rows_result_does_not_depend_on_its_batch(dtype):
    """The same row gives the same bits alone and among other rows (no batch-dependent rounding)."""
    _tier(dtype)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(6, 64, generator=generator).to(dtype)
    y = torch.randn(6, 300, generator=generator).to(dtype)
    a = torch.randn(3, 24, 64, generator=generator).to(dtype)
    b = torch.randn(3, 24, 300, generator=generator).to(dtype)
    together = cpu_kernels.lora_update(x, y, a, b, torch.tensor([0, 1, 2, 0, -1, 1]))
    alone = cpu_kernels.lora_update(x[3:4], y[3:4], a, b, torch.tensor([0]))
    assert torch.equal(together[3], alone[0])


def test_bad_inputs_are_refused_with_a_message():
    dtype = _tier(torch.float32)
    x, y = torch.zeros(2, 8, dtype=dtype), torch.zeros(2, 5, dtype=dtype)
    a, b = torch.zeros(2, 4, 8, dtype=dtype), torch.zeros(2, 4, 5, dtype=dtype)
    cases = [
        (lambda: cpu_kernels.lora_update(x, y, a, b, torch.tensor([0, 2])), "slot 2 out of range"),
        (lambda: cpu_kernels.lora_update(x, y, a, b, torch.tensor([0])), "one int64 slot per row"),
        (lambda: cpu_kernels.lora_update(x, y, a, b.transpose(1, 2), torch.tensor([0, 0])), "expected a"),
        (lambda: cpu_kernels.lora_update(x, y, a.double(), b, torch.tensor([0, 0])), "share one dtype"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()

"""The one decision of backend and kernel tier, from its facts: what runs, the notes that say why
when it was asked or is the machine's limit, and a fault with its cost when our kernels should
have run. The facts are built here; tests/integration/test_kernel_fallbacks.py makes a real
compiler and loader fail."""

from __future__ import annotations

import pytest
import torch

from kunlun_runtime.errors import ConfigError
from kunlun_runtime.layers import cpu_kernels
from kunlun_runtime.layers.kernel_choice import (
    WIDE_ATTENTION,
    WIDE_LINEARS,
    KernelChoice,
    KernelStatus,
    choose_kernels,
    decide,
    fallback_cost,
    kernel_status,
    large_batch_dtype,
    large_batches_in_fp32,
    wide_note,
)
from kunlun_runtime.platforms.cpu_features import IsaTier, cpu_capabilities

BF16, FP32 = torch.bfloat16, torch.float32
LOADED_AVX512 = KernelStatus(IsaTier.AVX512, None, failed=False)
LOADED_AVX2 = KernelStatus(IsaTier.AVX2, None, failed=False)
BUILD_FAILED = KernelStatus(
    IsaTier.AVX512, "building the avx512 CPU kernels failed: x.cpp:3: error: boom", failed=True
)
LOAD_FAILED = KernelStatus(IsaTier.AVX2, "loading /k/kunlun_avx2.so failed: undefined symbol: f", failed=True)
CPU_BELOW = KernelStatus(
    IsaTier.AVX512, "the avx512 kernels need the avx512 ISA tier; this CPU is avx2", False
)


def test_loaded_kernels_run_native_with_their_tier_and_no_notes() -> None:
    assert decide("auto", True, BF16, BF16, "cpu", LOADED_AVX512, None) == KernelChoice(
        "native", "avx512", True
    )
    assert decide("auto", True, FP32, BF16, "cpu", LOADED_AVX2, "no oneDNN") == KernelChoice(
        "native", "avx2", True, large_batches="float32"
    )


def test_large_batches_compute_in_fp32_where_fmas_outrun_bf16_dot_products_and_there_is_no_amx() -> None:
    assert large_batch_dtype("fma", amx=False) == FP32
    assert large_batch_dtype("fma", amx=True) == BF16  # oneDNN's BF16 GEMM runs on the AMX tiles
    assert large_batch_dtype("dpbf16", amx=False) == BF16
    assert large_batch_dtype(None, amx=False) == BF16  # our AVX-512 library does not run here
    wide = decide("auto", True, BF16, BF16, "cpu", LOADED_AVX512, None, wide_large_batches=True)
    assert wide == KernelChoice("native", "avx512", True, (wide_note(True, True),), large_batches="float32")
    assert wide.describe()["large_batches"] == "float32"
    assert WIDE_LINEARS in wide.notes[0] and WIDE_ATTENTION in wide.notes[0]
    # Only our own linears and attention widen: oneDNN-prepacked or plain BF16 linears stay BF16,
    # and without our native layers a prompt's attention does too.
    plain = decide("plain", True, BF16, BF16, "cpu", LOADED_AVX512, None, wide_large_batches=True)
    assert plain.large_batches == "bfloat16" and plain.notes[-1] == wide_note(False, True)
    assert WIDE_LINEARS not in plain.notes[-1]
    neither = decide("prepacked", False, BF16, BF16, "cpu", LOADED_AVX512, None, wide_large_batches=True)
    assert neither.large_batches == "bfloat16" and not any("FP32" in note for note in neither.notes)
    assert decide("auto", False, BF16, BF16, "cpu", LOADED_AVX512, None, wide_large_batches=True).notes == (
        "--no-native-kernels as asked",
        wide_note(True, False),
    )


def test_the_choice_on_this_machine_reports_what_its_large_batches_compute_in() -> None:
    choice = choose_kernels("auto", BF16, torch.device("cpu"))
    if choice.backend != "native":
        assert choice.large_batches == "bfloat16"
    else:
        assert choice.large_batches == ("float32" if large_batches_in_fp32() else "bfloat16")
        assert (wide_note(True, True) in choice.notes) == large_batches_in_fp32()


def test_a_build_that_failed_falls_back_with_its_reason_and_cost() -> None:
    choice = decide("auto", True, BF16, BF16, "cpu", BUILD_FAILED, None)
    assert choice == KernelChoice(
        "prepacked",
        "none",
        False,
        (),
        "building the avx512 CPU kernels failed: x.cpp:3: error: boom",
        fallback_cost("prepacked", BF16),
    )
    assert choice.cost == (
        "decode runs on oneDNN-prepacked BF16 linears and PyTorch attention: 0.38-0.46x of its speed "
        "with our kernels where measured (docs/performance.md)"
    )


def test_a_library_that_did_not_load_on_avx2_falls_back_to_the_plain_floor() -> None:
    choice = decide("auto", True, FP32, BF16, "cpu", LOAD_FAILED, "the CPU lacks avx512bw")
    assert (choice.backend, choice.tier, choice.native_layers) == ("plain", "none", False)
    assert choice.fault == "loading /k/kunlun_avx2.so failed: undefined symbol: f"
    assert (
        choice.cost is not None and "every BF16 weight widened to FP32 each step: 0.12-0.17x" in choice.cost
    )


def test_a_cpu_below_the_tier_is_a_note_not_a_fault() -> None:
    choice = decide("auto", True, BF16, BF16, "cpu", CPU_BELOW, "the CPU lacks avx512bw")
    assert choice == KernelChoice("plain", "none", False, (CPU_BELOW.reason,))


def test_what_was_asked_is_noted_and_the_tier_runs_where_any_of_our_kernels_do() -> None:
    plain = decide("plain", True, BF16, BF16, "cpu", LOADED_AVX512, None)
    assert plain == KernelChoice("plain", "avx512", True, ("--linear-backend plain as asked",))
    neither = decide("prepacked", False, BF16, BF16, "cpu", LOADED_AVX512, None)
    assert neither == KernelChoice(
        "prepacked", "none", False, ("--linear-backend prepacked as asked", "--no-native-kernels as asked")
    )


def test_fp32_weights_and_accelerators_use_none_of_our_kernels() -> None:
    fp32 = decide("auto", True, FP32, FP32, "cpu", None, None)
    assert fp32 == KernelChoice(
        "plain",
        "none",
        False,
        ("our kernels take BF16 weights; the weights are float32",),
        large_batches="float32",
    )
    cuda = decide("auto", True, BF16, BF16, "cuda", None, None)
    assert cuda == KernelChoice("plain", "none", False, ("cuda: PyTorch's device kernels",))


def test_require_native_turns_a_fault_into_a_config_error_naming_the_reason(monkeypatch) -> None:
    dtype = BF16 if cpu_capabilities().computes_bf16 else FP32  # the tier this CPU runs under auto
    tier = cpu_kernels.tier_for_dtype(dtype)
    assert tier is not None
    if cpu_kernels.cpu_reason(tier) is not None:
        pytest.skip("this CPU runs none of our kernel tiers: nothing can fail to load")
    reason = f"building the {tier.tier.value} CPU kernels failed: no compiler"
    monkeypatch.setattr(cpu_kernels, "_build", lambda _: reason)
    assert kernel_status(dtype) == KernelStatus(tier.tier, reason, failed=True)
    with pytest.raises(ConfigError, match=f"did not load: {reason}; without them decode runs on") as caught:
        choose_kernels("auto", dtype, torch.device("cpu"), BF16, require_native=True)
    assert caught.value.field == "require_native_kernels"
    assert (
        choose_kernels("auto", dtype, torch.device("cpu"), BF16).fault == reason
    )  # without: the warning's case

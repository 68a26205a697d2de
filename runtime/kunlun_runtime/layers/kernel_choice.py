"""The one place that decides how the linears compute and which of our kernel tiers runs.

The linear backend: ``native`` (our kernels), ``prepacked`` (oneDNN's blocked BF16 weights) or
``plain`` (PyTorch). The kernel tier: the library of ours that runs (``avx512``: BF16 activations,
``avx2``: FP32 ones), else ``none``. ``choose_kernels`` gathers the facts (the CPU's tier, whether
the library builds and loads, whether oneDNN's BF16 path runs) and ``decide`` turns them into a
``KernelChoice``: the choice, notes on what was asked or what the machine lacks, and, when our
kernels should run here but did not build or load, that fault and what it costs. A fault is never
silent: ``require_native`` turns it into a ConfigError, and otherwise the start line's warning
(``runtime_info``) carries it.

Invariant: never a backend the CPU cannot run; never a fault without its reason.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kunlun_runtime.config import EngineConfig
from kunlun_runtime.errors import ConfigError
from kunlun_runtime.layers import cpu_kernels
from kunlun_runtime.platforms.cpu_features import IsaTier, cpu_capabilities

# oneDNN's BF16 weight reorder refuses CPUs without these ("bf16 path needs the cpu support
# avx_ne_convert or avx512bw, avx512vl and avx512dq").
ONEDNN_BF16_FLAGS = ("avx512bw", "avx512vl", "avx512dq")
# What decode loses without our kernels, by the backend that runs instead: the ablations of
# docs/performance.md, as a fraction of decode speed with our kernels on the CPUs measured there.
_COSTS = {
    ("prepacked", torch.bfloat16): "oneDNN-prepacked BF16 linears and PyTorch attention: 0.38-0.46x",
    ("plain", torch.bfloat16): "plain PyTorch BF16 linears and attention: 0.31-0.40x",
    ("plain", torch.float32): "plain PyTorch, every BF16 weight widened to FP32 each step: 0.12-0.17x",
}


@dataclass(frozen=True, slots=True)
class KernelStatus:
    """Whether the kernels for one activation dtype run here, and if not, why."""

    tier: IsaTier | None  # the tier that computes in the dtype; None: no tier does
    reason: str | None  # None: loaded
    failed: bool  # the CPU runs the tier but its library did not build or load: a fault, not a limit

    @property
    def loaded(self) -> bool:
        return self.reason is None


@dataclass(frozen=True, slots=True)
class KernelChoice:
    backend: str  # the linear backend: native | prepacked | plain
    tier: str  # the kernel tier whose library runs: avx512 | avx2 | none
    native_layers: bool  # our norm, attention and layer-stack kernels run (--native-kernels)
    notes: tuple[str, ...] = ()  # why it is what it is where that was asked or is the machine's limit
    fault: str | None = None  # our kernels should run here but did not build or load: why
    cost: str | None = None  # what the fault costs
    # What our native BF16 linears of a large batch (a prefill: linear.WIDE_FROM_ROWS rows or
    # more) compute in: bfloat16 | float32 (large_batch_dtype)
    large_batches: str = "bfloat16"

    def describe(self) -> dict[str, object]:
        return {
            "backend": self.backend,
            "tier": self.tier,
            "native_layers": self.native_layers,
            "large_batches": self.large_batches,
            "notes": list(self.notes),
            "fault": self.fault,
            "cost": self.cost,
        }


def kernel_status(dtype: torch.dtype) -> KernelStatus:
    """``cpu_kernels.unavailable_reason`` (building on first call), told apart: a CPU below the
    tier is the machine's limit; a build or load that failed on a CPU that runs it is a fault."""
    tier = cpu_kernels.tier_for_dtype(dtype)
    reason = cpu_kernels.unavailable_reason(dtype)
    failed = False
    if reason is not None and tier is not None:
        try:
            failed = cpu_kernels.cpu_reason(tier) is None
        except ConfigError:  # a bad KUNLUN_CPU_ISA, which the reason names
            failed = False
    return KernelStatus(None if tier is None else tier.tier, reason, failed)


def onednn_bf16_reason() -> str | None:
    """Why oneDNN's BF16 weight path cannot run under the tier in force (None: it can)."""
    capabilities = cpu_capabilities()
    if capabilities.tier >= IsaTier.AVX512:
        return None
    if capabilities.tier != capabilities.detected_tier:
        return f"KUNLUN_CPU_ISA={capabilities.tier.value} is in force"
    flags = capabilities.flags
    if "avx_ne_convert" in flags or all(flag in flags for flag in ONEDNN_BF16_FLAGS):
        return None
    lacking = [flag for flag in ONEDNN_BF16_FLAGS if flag not in flags]
    return f"the CPU lacks {', '.join(lacking)} (or avx_ne_convert)"


def fallback_cost(backend: str, dtype: torch.dtype) -> str:
    """What decode runs on without our kernels, and its measured share of their speed."""
    runs_on = _COSTS.get((backend, dtype))
    if runs_on is None:
        return f"decode runs on {backend} linears in {_name(dtype)}, without our kernels"
    return f"decode runs on {runs_on} of its speed with our kernels where measured (docs/performance.md)"


# Why a prefill computes in FP32 where large_batch_dtype says so: "{what}" is what does.
WIDE_LARGE_BATCHES = (
    "prefill in FP32 ({what}): this CPU's FP32 FMAs outrun its BF16 dot products, and it has no AMX "
    "for oneDNN's BF16 GEMM"
)
WIDE_LINEARS = "linears over BF16 weights widened chunk by chunk"
WIDE_ATTENTION = "a prompt's attention"


def wide_note(linears: bool, attention: bool) -> str:
    """The start line's note on what of a prefill computes in FP32 (at least one of the two)."""
    what = [name for name, wide in ((WIDE_LINEARS, linears), (WIDE_ATTENTION, attention)) if wide]
    return WIDE_LARGE_BATCHES.format(what=", ".join(what))


def large_batch_dtype(bf16_dot: str | None, amx: bool) -> torch.dtype:
    """What the BF16 linears of a batch past our kernels' rows (prefill, a large mixed step)
    compute in (pure): FP32, by oneDNN's SGEMM over the weight widened chunk by chunk, where our
    AVX-512 library's probe chose FP32 FMAs for its BF16 dot products (``bf16_dot`` ``fma``: at
    least 1.5x VDPBF16PS's rate) and the CPU has no AMX, on which oneDNN runs BF16 far faster;
    else BF16 (oneDNN's BF16 GEMM, whose dot products are VDPBF16PS). Both accumulate the exact
    products of BF16 values in FP32 and round once; only the order of the sums differs. A prompt's
    own attention, in our native attention path, follows the same choice (``attention_backend``)."""
    return torch.float32 if bf16_dot == "fma" and not amx else torch.bfloat16


@functools.cache
def large_batches_in_fp32() -> bool:
    """``large_batch_dtype`` on this machine, decided once per process."""
    amx = "amx_bf16" in cpu_capabilities().flags  # oneDNN's own dispatch: whatever tier is in force
    return large_batch_dtype(cpu_kernels.bf16_dot(), amx) == torch.float32


def decide(
    requested: str,
    native_kernels: bool,
    dtype: torch.dtype,
    weight_dtype: torch.dtype,
    device_type: str,
    kernels: KernelStatus | None,
    onednn_reason: str | None,
    *,
    wide_large_batches: bool = False,
) -> KernelChoice:
    """The choice from the facts (pure). ``kernels`` is None where they were not consulted;
    ``wide_large_batches``: ``large_batches_in_fp32``, which our native linears (past their own
    kernels' rows) and our native attention (a fresh prompt's) follow."""
    if device_type != "cpu":
        backend = "plain" if requested == "auto" else requested
        device_notes = (f"{device_type}: PyTorch's device kernels",)
        return KernelChoice(backend, "none", False, device_notes, large_batches=_name(dtype))
    loaded = kernels is not None and kernels.loaded
    if requested != "auto":
        backend = requested
    elif weight_dtype == torch.bfloat16 and loaded:
        backend = "native"
    elif weight_dtype == dtype == torch.bfloat16 and onednn_reason is None:
        backend = "prepacked"
    else:
        backend = "plain"
    native_layers = native_kernels and loaded
    uses_library = loaded and (backend == "native" or native_layers)
    tier = kernels.tier.value if uses_library and kernels is not None and kernels.tier else "none"
    notes: list[str] = []
    if weight_dtype != torch.bfloat16:
        notes.append(f"our kernels take BF16 weights; the weights are {_name(weight_dtype)}")
    if kernels is not None and kernels.reason is not None and not kernels.failed:
        notes.append(kernels.reason)
    if loaded and requested in ("plain", "prepacked"):
        notes.append(f"--linear-backend {requested} as asked")
    if loaded and not native_kernels:
        notes.append("--no-native-kernels as asked")
    if kernels is not None and kernels.failed:
        return KernelChoice(
            backend, tier, False, tuple(notes), kernels.reason, fallback_cost(backend, dtype), _name(dtype)
        )
    wide = wide_large_batches and dtype == weight_dtype == torch.bfloat16
    wide_linears, wide_attention = wide and backend == "native", wide and native_layers
    if wide_linears or wide_attention:
        notes.append(wide_note(wide_linears, wide_attention))
    large = _name(torch.float32 if wide_linears else dtype)
    return KernelChoice(backend, tier, native_layers, tuple(notes), large_batches=large)


def choose_kernels(
    requested: str,
    dtype: torch.dtype,
    device: torch.device,
    weight_dtype: torch.dtype | None = None,
    *,
    native_kernels: bool = True,
    require_native: bool = False,
) -> KernelChoice:
    """Decides for compute ``dtype`` and ``weight_dtype`` (default: the same) on ``device``, building
    our kernels on first call where they may run.

    Raises ConfigError when an explicit ``native`` or ``prepacked`` cannot run here, naming the
    setting and what the CPU lacks, and, with ``require_native``, when our kernels should run here
    but did not build or load.
    """
    weight_dtype = weight_dtype or dtype
    on_cpu = device.type == "cpu"
    if requested == "native":
        require_native_backend(dtype)
    if requested == "prepacked" and on_cpu and weight_dtype == torch.bfloat16:
        require_prepacked(dtype)
    consult = (
        on_cpu and weight_dtype == torch.bfloat16 and (requested in ("auto", "native") or native_kernels)
    )
    kernels = kernel_status(dtype) if consult else None
    onednn_reason = onednn_bf16_reason() if on_cpu else None
    wide = (
        consult
        and dtype == torch.bfloat16
        and kernels is not None
        and kernels.loaded
        and large_batches_in_fp32()
    )
    choice = decide(
        requested,
        native_kernels,
        dtype,
        weight_dtype,
        device.type,
        kernels,
        onednn_reason,
        wide_large_batches=wide,
    )
    if require_native and choice.fault is not None:
        raise ConfigError(
            f"require_native_kernels: the engine runs on the CPU and our CPU kernels did not load: "
            f"{choice.fault}; without them "
            f"{choice.cost}. Give the build a C++ compiler or prebuilt libraries "
            "($KUNLUN_CPU_KERNELS_DIR), or drop --require-native-kernels / "
            "KUNLUN_REQUIRE_NATIVE_KERNELS=1 to run without them",
            field="require_native_kernels",
        )
    return choice


def choose_for_config(
    config: EngineConfig, dtype: torch.dtype, weight_dtype: torch.dtype, device: torch.device
) -> KernelChoice:
    """``choose_kernels`` with the engine options' backend, kernel and requirement flags."""
    return choose_kernels(
        config.linear_backend,
        dtype,
        device,
        weight_dtype,
        native_kernels=config.native_kernels,
        require_native=config.require_native_kernels,
    )


def require_prepacked(dtype: torch.dtype) -> None:
    reason = onednn_bf16_reason()
    if dtype != torch.bfloat16:
        reason = f"it computes in BF16 but the compute dtype is {dtype}"
    if reason is not None:
        raise ConfigError(
            f"linear_backend: prepacked (oneDNN BF16) is unavailable here: {reason}", field="linear_backend"
        )


def require_native_backend(dtype: torch.dtype = torch.bfloat16) -> None:
    if not cpu_kernels.load(dtype):
        raise ConfigError(
            f"linear_backend: native is unavailable here: {cpu_kernels.unavailable_reason(dtype)}",
            field="linear_backend",
        )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

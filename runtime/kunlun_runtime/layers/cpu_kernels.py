"""Our own CPU kernels (``csrc/``), one library per ISA tier, built once per machine with the local
C++ compiler and cached.

A tier is named by the activations it computes on: the AVX-512 tier (``csrc/avx512``, BF16
activations; AMX tiles where granted) and the AVX2 tier (``csrc/avx2``, FP32 activations: BF16 is
emulated on AVX2, so weights stay BF16 or INT8 and are widened in registers). Both implement
``csrc/kernels.h``; each library registers its own op namespace (``torch.ops.kunlun_avx512``,
``torch.ops.kunlun_avx2``), so a process may load both and an AVX-512 machine tests both. The
functions below pick the library from the activations' dtype.

``load(dtype)`` is True when the tier for ``dtype`` runs here: the tier in force
(``platforms.cpu_features``, ``KUNLUN_CPU_ISA``) includes it, and either a prebuilt library sits in
``$KUNLUN_CPU_KERNELS_DIR`` (what the runtime image ships: ``python -m
kunlun_runtime.layers.cpu_kernels --build-to DIR`` makes every tier on any x86 machine with a
compiler) or a compiler builds it on first use (into ``$TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``; later processes load the cached library in milliseconds; while it
compiles, ``kernel_build`` reports what and how far). Otherwise ``unavailable_reason(dtype)`` says
what is missing (the CPU's tier, the build's first error line, the loader's message), and
``kernel_choice`` decides what runs instead and makes sure it is said.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from kunlun_runtime.errors import ConfigError
from kunlun_runtime.layers import kernel_build
from kunlun_runtime.platforms.cpu_features import IsaTier, cpu_capabilities

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"


@dataclass(frozen=True, slots=True)
class KernelTier:
    """One kernel library: its tier, op namespace, activation dtype, sources and flags."""

    tier: IsaTier
    namespace: str
    activation_dtype: torch.dtype
    sources: tuple[Path, ...]
    compile_flags: tuple[str, ...]


_COMMON_SOURCES = (CSRC / "decode_layers.cpp", CSRC / "registration.cpp")
_COMMON_FLAGS = ("-O3", "-fopenmp", "-fvisibility=hidden")
TIERS = {
    IsaTier.AVX512: KernelTier(
        tier=IsaTier.AVX512,
        namespace="kunlun_avx512",
        activation_dtype=torch.bfloat16,
        sources=(
            CSRC / "avx512" / "small_batch_linear.cpp",
            CSRC / "avx512" / "amx_linear.cpp",
            CSRC / "avx512" / "decode_ops.cpp",
            CSRC / "avx512" / "decode_attention.cpp",
            CSRC / "avx512" / "argmax.cpp",
            *_COMMON_SOURCES,
        ),
        compile_flags=(
            *_COMMON_FLAGS,
            "-mavx512f",
            "-mavx512bw",
            "-mavx512vl",
            "-mavx512dq",
            "-mavx512bf16",
            "-mavx512vnni",
            "-mamx-tile",
            "-mamx-bf16",
        ),
    ),
    IsaTier.AVX2: KernelTier(
        tier=IsaTier.AVX2,
        namespace="kunlun_avx2",
        activation_dtype=torch.float32,
        sources=(
            CSRC / "avx2" / "linear_bf16.cpp",
            CSRC / "avx2" / "linear_int8.cpp",
            CSRC / "avx2" / "decode_ops.cpp",
            CSRC / "avx2" / "decode_attention.cpp",
            CSRC / "avx2" / "argmax.cpp",
            *_COMMON_SOURCES,
        ),
        compile_flags=(*_COMMON_FLAGS, "-mavx2", "-mfma", "-mf16c"),
    ),
}
SOURCES = tuple(dict.fromkeys(source for tier in TIERS.values() for source in tier.sources))
HEADERS = (
    CSRC / "kernels.h",
    CSRC / "paged_cache.h",
    CSRC / "attention_plan.h",
    CSRC / "avx512" / "bf16_dot.h",
    CSRC / "avx512" / "bf16_vec.h",
    CSRC / "avx512" / "amx_linear.h",
    CSRC / "avx512" / "rotary_cache.h",
    CSRC / "avx2" / "vec_avx2.h",
    CSRC / "avx2" / "rotary_cache.h",
    CSRC / "avx2" / "linear_tiles.h",
    CSRC / "avx2" / "attention_tiles.h",
)
PREBUILT_ENV = "KUNLUN_CPU_KERNELS_DIR"
# The largest decode steps our linears and the one-call layer stack take instead of oneDNN layer by
# layer, and the rows each read of the weights serves: BF16 runs up to 32 rows in one AVX-512 pass
# (groups of 8 over each block of weights) and more in passes of 32, or 3-16 rows in one AMX pass
# where AMX is granted (more in passes of 16); the INT8 kernels are compute-bound above 8. Past 16
# rows oneDNN's BF16 GEMM took 1.2-1.8x our time, and a batch of 8 decodes with its drafts needs
# more than 16 rows to draft more than one token each.
MAX_ROWS = 64
PASS_ROWS = 32
INT8_MAX_ROWS = 8
AMX_PASS_ROWS = 16


def weight_pass_rows(quantized: bool) -> int:
    """The most decode rows our linears serve with one read of the weights, on every tier: a
    larger batch runs in passes, each streaming every weight again (the scheduler's step-cost
    model prices them). AMX takes BF16 rows a tile of 16 at a time."""
    if quantized:
        return INT8_MAX_ROWS
    return AMX_PASS_ROWS if cpu_capabilities().tier is IsaTier.AMX else PASS_ROWS


def tier_for_dtype(dtype: torch.dtype) -> KernelTier | None:
    """The kernel tier whose activations are ``dtype`` (None: no kernels compute in it)."""
    return next((tier for tier in TIERS.values() if tier.activation_dtype == dtype), None)


def _library_name(tier: KernelTier) -> str:
    # The name carries a digest of the sources, flags and torch version, so an edited kernel, or
    # one built against another torch (whose headers and ABI it compiled in), is rebuilt rather
    # than loaded from the cache as it was.
    text = (
        b"".join(path.read_bytes() for path in (*tier.sources, *HEADERS))
        + " ".join(tier.compile_flags).encode()
        + f" torch {torch.__version__}".encode()
    )
    return f"{tier.namespace}_{hashlib.sha256(text).hexdigest()[:10]}"


def _cflags(tier: KernelTier) -> list[str]:
    return [*tier.compile_flags, f"-DKUNLUN_OPS={tier.namespace}"]


def _sources(tier: KernelTier) -> list[str]:
    return [str(source) for source in tier.sources]


@functools.cache
def _build(tier_name: IsaTier) -> str | None:
    """Loads (building if needed) a tier's library; returns None on success, else why it is unavailable."""
    tier = TIERS[tier_name]
    reason = cpu_reason(tier)
    if reason is not None:
        return reason
    prebuilt_dir = os.environ.get(PREBUILT_ENV)
    if prebuilt_dir:
        path = Path(prebuilt_dir) / f"{tier.namespace}.so"
        error = kernel_build.load_library(path)
        if error is not None:
            return f"loading {path} ({PREBUILT_ENV}) failed: {error}"
        log.info("loaded the %s CPU kernels from %s (%s)", tier.tier.value, path, PREBUILT_ENV)
        return None
    cached = kernel_build.cached_library(_library_name(tier))
    if cached.exists():
        error = kernel_build.load_library(cached)
        if error is None:
            log.info("loaded the %s CPU kernels built earlier (cached in %s)", tier.tier.value, cached.parent)
            return None
        # Removed, so that the build below links it anew instead of finding it up to date.
        log.warning(
            "the %s CPU kernels cached in %s do not load (%s): rebuilding", tier.tier.value, cached, error
        )
        cached.unlink(missing_ok=True)
    try:
        with kernel_build.building(
            tier.tier.value, cached.parent, tuple(Path(s).name for s in _sources(tier))
        ):
            kernel_build.compile_and_load(_library_name(tier), _sources(tier), _cflags(tier))
    except Exception as exc:  # no compiler, no ninja, a compile error: all mean "not here"
        error = kernel_build.first_error_line(str(exc) or repr(exc))
        return f"building the {tier.tier.value} CPU kernels failed: {error}"
    return None


def cpu_reason(tier: KernelTier) -> str | None:
    """Why the tier in force cannot run ``tier``'s library (None: it can). Raises ConfigError for
    a bad KUNLUN_CPU_ISA."""
    capabilities = cpu_capabilities()
    if capabilities.tier >= tier.tier:
        return None
    forced = capabilities.tier != capabilities.detected_tier
    return f"the {tier.tier.value} kernels need the {tier.tier.value} ISA tier; " + (
        f"KUNLUN_CPU_ISA={capabilities.tier.value} is in force"
        if forced
        else f"this CPU ({capabilities.model_name}) is {capabilities.detected_tier.value}"
    )


def cached_library(tier: KernelTier) -> Path:
    """Where a compile of ``tier`` (these sources and flags) leaves its library."""
    return kernel_build.cached_library(_library_name(tier))


def load(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether our kernels for ``dtype`` activations run here (building them on first call)."""
    return unavailable_reason(dtype) is None


def unavailable_reason(dtype: torch.dtype = torch.bfloat16) -> str | None:
    tier = tier_for_dtype(dtype)
    if tier is None:
        return f"no kernel tier computes in {dtype}"
    try:
        return _build(tier.tier)
    except ConfigError as exc:  # a bad KUNLUN_CPU_ISA
        return str(exc)


def _ops_for_tier(tier: IsaTier):
    return getattr(torch.ops, TIERS[tier].namespace)


def _ops(activations: torch.Tensor):
    return _ops_for_tier(IsaTier.AVX512 if activations.dtype == torch.bfloat16 else IsaTier.AVX2)


@functools.cache
def _argmax_tier() -> IsaTier:
    # Decided once per process (the tier in force does not change): greedy sampling calls this
    # every step.
    return IsaTier.AVX512 if load(torch.bfloat16) else IsaTier.AVX2


def bf16_dot() -> str | None:
    """How the AVX-512 library takes BF16 dot products where it may choose: ``fma`` (FP32 FMAs
    over widened values, where its probe found them VDPBF16PS's bits and at least 1.5x its rate)
    or ``dpbf16``; None where that library does not run here."""
    if not load(torch.bfloat16):
        return None
    return str(_ops_for_tier(IsaTier.AVX512).bf16_dot())


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _ops(x).linear_bf16(x, weight, bias)


def linear_int8(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return _ops(x).linear_int8(x, weight, scales, bias)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(logits, dim=-1)`` for contiguous FP32 [S, V] logits, one vector pass per row
    in the best tier loaded (torch's generic reduction is slow enough over a whole vocabulary to
    show in every greedy decode step)."""
    return _ops_for_tier(_argmax_tier()).argmax_rows(logits)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _ops(x).rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, its RMSNorm) in one pass, rounded as the eager ops round in x's dtype."""
    return _ops(x).add_rms_norm(x, delta, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dimension (in BF16 with the eager
    path's roundings: bf16(bf16(silu(gate)) * up))."""
    return _ops(gate_up).silu_mul(gate_up)


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int,
) -> torch.Tensor:
    """Rotary, KV write and paged attention for one new token per sequence (see decode_attention.cpp)."""
    return _ops(q).decode_attention(
        q, k, v, cos, sin, k_blocks, v_blocks, block_tables, context_lens, scale, window
    )


def rotary_kv_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    slot_block_ids: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary on q and k and the K/V write into the paged cache for any number of tokens;
    returns (rotated q, rotated k) (see decode_ops.cpp)."""
    return _ops(q).rotary_kv_write(q, k, v, cos, sin, k_blocks, v_blocks, slot_block_ids, slot_offsets)


def decode_layers(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    weights: list[torch.Tensor],
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    shape: tuple[int, int, int],
    eps: float,
    scale: float,
    window: int,
    lora: list[torch.Tensor] | None = None,
    lora_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every decoder layer of a decode step in one call (see decode_layers.cpp for ``weights``);
    ``shape`` is (num_heads, num_kv_heads, head_dim); ``lora``: the LoRA slots' tensors, with each
    sequence's slot in ``lora_slots`` (None: no adapter in the step)."""
    slots = _NO_SLOTS if lora_slots is None else lora_slots
    return _ops(x).decode_layers(
        x,
        cos,
        sin,
        weights,
        k_caches,
        v_caches,
        block_tables,
        context_lens,
        *shape,
        eps,
        scale,
        window,
        lora or [],
        slots,
    )


_NO_SLOTS = torch.empty(0, dtype=torch.long)


def lora_update(
    x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """``y`` plus each row's LoRA update (``layers.lora``; the decode step's own operator)."""
    return _ops(x).lora_update(x, y, a, b, slots)


def main(argv: list[str] | None = None) -> int:
    """``--build-to DIR``: compile every tier's library into DIR (the build host need not run them:
    nothing is loaded)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--build-to", type=Path, required=True)
    args = parser.parse_args(argv)
    args.build_to.mkdir(parents=True, exist_ok=True)
    for tier in TIERS.values():
        library = kernel_build.compile_only(_library_name(tier), _sources(tier), _cflags(tier))
        shutil.copy2(library, args.build_to / f"{tier.namespace}.so")
        print(f"built {args.build_to / tier.namespace}.so")
    return 0


if __name__ == "__main__":
    sys.exit(main())

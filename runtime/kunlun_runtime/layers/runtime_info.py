"""What the engine runs with, said once at start and kept for ``/version``, ``--version`` and the
``kunlun:runtime_info`` gauge: the linear backend and kernel tier (``kernel_choice``), the compute,
weight and KV-cache dtypes and the KV capacity in tokens.

``announce_start`` logs the one start line, and a WARNING beside it when our kernels should run
here but did not build or load (why, and what it costs). ``kernels_without_model`` answers what
``--version`` can know without a model: the tier this CPU runs under ``--dtype auto`` and whether
its library is there and loads, without compiling anything.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass

import torch

from kunlun_runtime.layers import cpu_kernels, kernel_build
from kunlun_runtime.layers.kernel_choice import KernelChoice, KernelStatus, decide, onednn_bf16_reason
from kunlun_runtime.platforms.cpu_features import cpu_capabilities

log = logging.getLogger(__name__)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class RuntimeInfo:
    device: str  # the torch device: "cpu", "cuda:0"
    kernels: KernelChoice
    dtype: torch.dtype  # activations
    weight_dtype: torch.dtype
    quantization: str | None  # "int8": weight-only INT8 linears
    kv_dtype: torch.dtype  # what the paged KV cache stores
    num_kv_tokens: int  # KV capacity of the whole pool, in tokens

    def describe(self) -> dict[str, object]:
        """A JSON-ready summary (``/version``)."""
        return {
            "device": self.device,
            **self.kernels.describe(),
            "dtype": dtype_name(self.dtype),
            "weight_dtype": dtype_name(self.weight_dtype),
            "quantization": self.quantization,
            "kv_dtype": dtype_name(self.kv_dtype),
            "num_kv_tokens": self.num_kv_tokens,
        }

    def labels(self) -> dict[str, str]:
        """The ``kunlun:runtime_info`` labels."""
        return {
            "backend": self.kernels.backend,
            "tier": self.kernels.tier,
            "dtype": dtype_name(self.dtype),
            "kv_dtype": dtype_name(self.kv_dtype),
        }

    def start_line(self) -> str:
        kernels = self.kernels
        weights = dtype_name(self.weight_dtype) + (f" ({self.quantization})" if self.quantization else "")
        notes = f" ({'; '.join(kernels.notes)})" if kernels.notes else ""
        return (
            f"device={self.device} backend={kernels.backend} tier={kernels.tier}{notes} "
            f"dtype={dtype_name(self.dtype)} weights={weights} kv_dtype={dtype_name(self.kv_dtype)} "
            f"kv_capacity={self.num_kv_tokens} tokens"
        )


def announce_start(info: RuntimeInfo, *, model: object, max_model_len: int, kv_cache_bytes: int) -> None:
    """Logs the engine's start line, and a WARNING when our kernels fell short here."""
    log.info(
        "engine ready: model=%s %s (%.1f MiB) max_model_len=%d",
        model,
        info.start_line(),
        kv_cache_bytes / 2**20,
        max_model_len,
    )
    if info.kernels.fault is not None:
        log.warning(
            "our CPU kernels are not running: %s; %s. Fix: a working C++ compiler for the first "
            "start, or prebuilt libraries in $KUNLUN_CPU_KERNELS_DIR; --require-native-kernels "
            "makes this a start error",
            info.kernels.fault,
            info.kernels.cost,
        )


def kernels_without_model() -> str:
    """The kernels ``--dtype auto`` would run here, known without a model and without compiling:
    a prebuilt library or an earlier build that loads, or a first start that will compile."""
    return _probe_without_model()[0]


def defaults_without_model(weight_dtype: torch.dtype, kv_dtype: torch.dtype) -> str:
    """What the start line would say of the backend, tier and dtypes under ``--dtype auto`` and
    ``--linear-backend auto`` on this CPU (``weight_dtype``, ``kv_dtype``: what auto resolves to
    here), known without a model and without compiling; a library not built yet counts as the one
    the first start builds."""
    dtype, reason = _auto_dtype(), _probe_without_model()[1]
    tier = cpu_kernels.tier_for_dtype(dtype)
    status = KernelStatus(None if tier is None else tier.tier, reason, failed=False)
    choice = decide("auto", True, dtype, weight_dtype, "cpu", status, onednn_bf16_reason())
    return (
        f"backend={choice.backend} tier={choice.tier} dtype={dtype_name(dtype)} "
        f"weights={dtype_name(weight_dtype)} kv_dtype={dtype_name(kv_dtype)}"
    )


def _auto_dtype() -> torch.dtype:
    return torch.bfloat16 if cpu_capabilities().computes_bf16 else torch.float32


def _probe_without_model() -> tuple[str, str | None]:
    """(what ``kernels_without_model`` says, why the library will not run here or None)."""
    dtype = _auto_dtype()
    tier = cpu_kernels.tier_for_dtype(dtype)
    assert tier is not None  # both auto dtypes have a tier
    reason = cpu_kernels.cpu_reason(tier)
    if reason is not None:
        return f"none ({reason}): the plain PyTorch path", reason
    name = f"{tier.tier.value} (--dtype auto computes in {dtype_name(dtype)} here)"
    if os.environ.get(cpu_kernels.PREBUILT_ENV):
        path = os.path.join(os.environ[cpu_kernels.PREBUILT_ENV], f"{tier.namespace}.so")
        error = cpu_kernels.unavailable_reason(dtype)  # with a prebuilt folder this loads, never compiles
        return f"{name}: " + (f"prebuilt in {path}, loads" if error is None else error), error
    cached = cpu_kernels.cached_library(tier)
    if cached.exists():
        error = kernel_build.load_library(cached)
        return f"{name}: built earlier (cached in {cached.parent}), " + (
            "loads" if error is None else f"does not load: {error}"
        ), error
    compiler = os.environ.get("CXX", "c++")
    found = shutil.which(compiler)
    where = f"with {found}" if found else f"but the compiler {compiler} is not on PATH"
    return f"{name}: not built yet; the first start compiles it once, {where}, into {cached.parent}", None

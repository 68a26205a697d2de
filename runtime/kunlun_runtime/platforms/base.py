"""The hardware seam: what the engine needs to know about the device it runs on.

The engine's algorithms are the same everywhere; a ``Platform`` supplies what differs between CPU,
CUDA and Kunlun XPU: the torch device, the dtypes it computes well, its memory and telemetry, its
cache-line size (the KV block allocator aligns to it) and its versions. Platforms never import
each other; ``detect()`` in ``platforms/__init__`` picks one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Telemetry:
    """A snapshot of device state; ``None`` where the platform cannot read a value."""

    utilization_ratio: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    temperature_celsius: float | None = None
    power_watts: float | None = None


@dataclass(frozen=True, slots=True)
class Versions:
    """Driver, firmware and compute-library versions (``None`` where not applicable)."""

    driver: str | None = None
    firmware: str | None = None
    compute_library: str | None = None


class Platform:
    """Base class of the hardware platforms; subclasses override what differs."""

    name: str = "base"
    device_type: str = "cpu"
    cache_line_bytes: int = 64
    # Cache geometry used to skew KV blocks: number of sets of the last-level cache slice that a
    # stride walks through. 2**12 sets × 64 B lines = 256 KiB period (a typical L2 way size).
    cache_num_sets: int = 4096
    distributed_backend: str = "gloo"

    def device(self, index: int = 0) -> torch.device:
        """The torch device of local rank ``index``."""
        return torch.device(self.device_type, index) if self.device_type != "cpu" else torch.device("cpu")

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.float32, torch.bfloat16)

    def default_dtype(self) -> torch.dtype:
        """The compute (activation) dtype of ``--dtype auto``: BF16 where the platform computes it
        natively, else FP32."""
        return torch.bfloat16 if torch.bfloat16 in self.supported_dtypes() else torch.float32

    def default_weight_dtype(self) -> torch.dtype:
        """The dtype weights are kept in under ``--dtype auto`` (the compute dtype unless the
        platform widens narrower weights in its kernels)."""
        return self.default_dtype()

    def total_memory_bytes(self) -> int:
        raise NotImplementedError

    def free_memory_bytes(self) -> int:
        raise NotImplementedError

    def telemetry(self) -> Telemetry:
        return Telemetry()

    def versions(self) -> Versions:
        return Versions()

    def set_device(self, local_rank: int) -> None:
        """Bind this process to the device of ``local_rank`` (its current device from now on).

        Tensor-parallel rank r calls it with r before joining the group or running any
        collective, so that no two ranks share a device. A no-op where there is no device to
        choose (CPU).
        """

    def current_device_index(self) -> int | None:
        """The device this process is bound to (``set_device``); None where there is none (CPU)."""
        return None

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on CPU)."""

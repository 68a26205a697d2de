"""CPU platform: memory and telemetry from /proc through psutil, cache line from the OS, and the
precision of ``--dtype auto`` from the ISA tier (``cpu_features``)."""

from __future__ import annotations

import os
from pathlib import Path

import psutil  # no types-psutil in the dev extras yet
import torch

from kunlun_runtime.platforms.base import Platform, Telemetry, Versions
from kunlun_runtime.platforms.cpu_features import cpu_capabilities


def read_cache_line_bytes(sysfs_root: Path = Path("/sys")) -> int:
    """The CPU's coherency line size from sysfs (64 when it cannot be read)."""
    path = sysfs_root / "devices/system/cpu/cpu0/cache/index0/coherency_line_size"
    try:
        value = int(path.read_text().strip())
    except (OSError, ValueError):
        return 64
    return value if value > 0 and value & (value - 1) == 0 else 64


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"

    def __init__(self) -> None:
        self.cache_line_bytes = read_cache_line_bytes()

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        # BF16 runs natively with AVX512-BF16/AMX; elsewhere it is emulated but still correct.
        return (torch.float32, torch.bfloat16)

    def default_dtype(self) -> torch.dtype:
        # Emulated BF16 arithmetic is several times slower than FP32 (every operation converts in
        # software; see docs/performance.md), so compute in FP32 there.
        return torch.bfloat16 if cpu_capabilities().computes_bf16 else torch.float32

    def default_weight_dtype(self) -> torch.dtype:
        # Weights stay BF16 everywhere: decode streams them from DRAM, and widening to FP32 in
        # registers costs nothing against that; an FP32 copy would double the bytes per token.
        return torch.bfloat16

    def total_memory_bytes(self) -> int:
        return int(psutil.virtual_memory().total)

    def free_memory_bytes(self) -> int:
        return int(psutil.virtual_memory().available)

    def telemetry(self) -> Telemetry:
        memory = psutil.virtual_memory()
        temperature = None
        try:
            sensors = psutil.sensors_temperatures() if hasattr(psutil, "sensors_temperatures") else {}
        except OSError:
            sensors = {}
        readings = [entry.current for entries in sensors.values() for entry in entries if entry.current]
        if readings:
            temperature = float(max(readings))
        return Telemetry(
            utilization_ratio=psutil.cpu_percent(interval=None) / 100.0,
            memory_used_bytes=int(memory.total - memory.available),
            memory_total_bytes=int(memory.total),
            temperature_celsius=temperature,
        )

    def versions(self) -> Versions:
        return Versions(driver=None, firmware=None, compute_library=f"torch-{torch.__version__}")

    @staticmethod
    def num_threads() -> int:
        return len(os.sched_getaffinity(0))

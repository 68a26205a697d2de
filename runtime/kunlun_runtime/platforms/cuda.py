"""CUDA platform: torch.cuda for memory, NVML (nvidia-ml-py, optional) for telemetry and driver."""

from __future__ import annotations

import torch

from kunlun_runtime.platforms.base import Platform, Telemetry, Versions


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    cache_line_bytes = 128
    distributed_backend = "nccl"

    @staticmethod
    def is_available() -> bool:
        return torch.cuda.is_available()

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        if torch.cuda.is_bf16_supported():
            return (torch.float32, torch.bfloat16, torch.float16)
        return (torch.float32, torch.float16)

    def total_memory_bytes(self) -> int:
        return int(torch.cuda.mem_get_info()[1])

    def free_memory_bytes(self) -> int:
        return int(torch.cuda.mem_get_info()[0])

    def telemetry(self) -> Telemetry:
        try:
            import pynvml
        except ImportError:
            free, total = torch.cuda.mem_get_info()
            return Telemetry(memory_used_bytes=int(total - free), memory_total_bytes=int(total))
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return Telemetry(
            utilization_ratio=pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0,
            memory_used_bytes=int(memory.used),
            memory_total_bytes=int(memory.total),
            temperature_celsius=float(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)),
            power_watts=pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
        )

    def versions(self) -> Versions:
        try:
            import pynvml

            pynvml.nvmlInit()
            driver = pynvml.nvmlSystemGetDriverVersion()
        except Exception:  # NVML missing or failing: the versions stay unknown, never fatal
            driver = None
        return Versions(driver=driver, compute_library=f"cuda-{torch.version.cuda}")

    def set_device(self, local_rank: int) -> None:
        torch.cuda.set_device(local_rank)

    def current_device_index(self) -> int | None:
        return int(torch.cuda.current_device())

    def synchronize(self) -> None:
        torch.cuda.synchronize()

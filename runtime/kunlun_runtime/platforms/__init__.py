"""Hardware platforms behind one interface; ``detect()`` picks the one to run on."""

from __future__ import annotations

from kunlun_runtime.errors import ConfigError
from kunlun_runtime.platforms.base import Platform, Telemetry, Versions
from kunlun_runtime.platforms.cpu import CpuPlatform
from kunlun_runtime.platforms.cuda import CudaPlatform

__all__ = ["CpuPlatform", "CudaPlatform", "Platform", "Telemetry", "Versions", "detect"]


def detect(device: str = "auto") -> Platform:
    """Return the platform for ``device`` (auto: CUDA when available, else CPU).

    Raises ConfigError when the asked-for device is not usable here, saying what is missing.
    """
    if device == "cpu":
        return CpuPlatform()
    if device == "cuda":
        if not CudaPlatform.is_available():
            raise ConfigError("device: cuda asked for but torch sees no CUDA device", field="device")
        return CudaPlatform()
    if device == "kunlun":
        raise ConfigError(
            "device: kunlun asked for but no Kunlun software stack (Kunlun PyTorch build, xpu-smi) "
            "is installed here",
            field="device",
        )
    if device == "auto":
        return CudaPlatform() if CudaPlatform.is_available() else CpuPlatform()
    raise ConfigError(f"device: unknown device {device!r}", field="device")

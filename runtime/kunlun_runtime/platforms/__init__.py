"""Hardware platforms behind one interface; ``detect()`` picks the one to run on.

Auto-detection order: Kunlun (only when its whole software stack is installed: Kunlun's PyTorch
build and ``xpu-smi``), then CUDA, then CPU. Kunlun comes first because its PyTorch build also
answers ``torch.cuda.is_available()``.
"""

from __future__ import annotations

from kunlun_runtime.errors import ConfigError
from kunlun_runtime.platforms.base import Platform, Telemetry, Versions
from kunlun_runtime.platforms.cpu import CpuPlatform
from kunlun_runtime.platforms.cuda import CudaPlatform

__all__ = ["CpuPlatform", "CudaPlatform", "Platform", "Telemetry", "Versions", "detect"]


def _kunlun(required: bool) -> Platform | None:
    # Imported here: kunlun_device is only needed when a Kunlun platform is asked for or probed.
    from kunlun_runtime.platforms.kunlun import KunlunPlatform, probe_stack

    stack = probe_stack()
    if stack.missing:
        if not required:
            return None
        raise ConfigError(
            "device: kunlun asked for but the Kunlun software stack is incomplete here; missing: "
            + "; ".join(stack.missing),
            field="device",
        )
    return KunlunPlatform()


def detect(device: str = "auto") -> Platform:
    """Return the platform for ``device`` (auto: Kunlun, else CUDA, else CPU).

    Raises ConfigError when the asked-for device is not usable here, saying what is missing.
    """
    if device == "cpu":
        return CpuPlatform()
    if device == "cuda":
        if not CudaPlatform.is_available():
            raise ConfigError("device: cuda asked for but torch sees no CUDA device", field="device")
        return CudaPlatform()
    if device == "kunlun":
        platform = _kunlun(required=True)
        assert platform is not None  # required=True raises instead of returning None
        return platform
    if device == "auto":
        kunlun = _kunlun(required=False)
        if kunlun is not None:
            return kunlun
        return CudaPlatform() if CudaPlatform.is_available() else CpuPlatform()
    raise ConfigError(f"device: unknown device {device!r}", field="device")

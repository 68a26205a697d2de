"""Kunlun XPU platform: Kunlun's PyTorch build for compute, ``kunlun_device.xpu`` for the card.

Kunlun's PyTorch build (the ``torch_xmlir`` extension and its ``xtorch_ops`` kernels, as used by
baidu/vLLM-Kunlun) presents each visible card as a ``cuda`` device, numbered from 0 in the order of
``XPU_VISIBLE_DEVICES``. That mapping, local rank → torch device → host card index, lives here and
only here (``torch_device_type``, ``visible_card_indices``, ``KunlunPlatform.host_index``).

Telemetry, memory and versions come from ``xpu-smi`` through ``kunlun_device.xpu.XpuSource``; this
module never parses tool output itself. Where ``xpu-smi`` and the host's ``/dev``/``sys`` are is
configurable through environment variables so tests point them at fixture hosts:

- ``KUNLUN_XPU_SMI``: the ``xpu-smi`` command (default ``xpu-smi`` on ``PATH``)
- ``KUNLUN_DEV_ROOT``: where the host's ``dev/``, ``sys/`` and KML version file are (default ``/``)
- ``KUNLUN_KML_VERSION_FILE``: host path of the KML version file (default the device plugin's)

Invariant: a reading the tool cannot give is ``None``, never a zero standing in for it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kunlun_device.errors import XpuError
from kunlun_device.xpu import DEFAULT_KML_VERSION_FILE, XpuSource
from kunlun_runtime.errors import ConfigError
from kunlun_runtime.platforms.base import Platform, Telemetry, Versions

logger = logging.getLogger(__name__)

XPU_SMI_ENV = "KUNLUN_XPU_SMI"
DEV_ROOT_ENV = "KUNLUN_DEV_ROOT"
KML_VERSION_FILE_ENV = "KUNLUN_KML_VERSION_FILE"
VISIBLE_DEVICES_ENV = "XPU_VISIBLE_DEVICES"
# Python modules of Kunlun's PyTorch build; any one of them means the build is installed.
TORCH_EXTENSION_MODULES = ("torch_xmlir", "xtorch_ops")


def torch_device_type() -> str:
    """The torch device type under which Kunlun's PyTorch build exposes the cards."""
    return "cuda"


def visible_card_indices(env: Mapping[str, str] | None = None) -> tuple[int, ...] | None:
    """Host card indices from ``XPU_VISIBLE_DEVICES`` (local rank i uses the i-th); None when unset.

    Raises:
        ConfigError: the variable is set but is not a comma-separated list of card indices.
    """
    value = (os.environ if env is None else env).get(VISIBLE_DEVICES_ENV)
    if value is None or not value.strip():
        return None
    parts = [part.strip() for part in value.split(",")]
    if not all(part.isdigit() for part in parts):
        raise ConfigError(
            f"{VISIBLE_DEVICES_ENV}: expected comma-separated card indices, got {value!r}",
            field=VISIBLE_DEVICES_ENV,
        )
    return tuple(int(part) for part in parts)


def source_from_env(env: Mapping[str, str] | None = None) -> XpuSource:
    """The ``XpuSource`` named by ``KUNLUN_XPU_SMI``, ``KUNLUN_DEV_ROOT``, ``KUNLUN_KML_VERSION_FILE``."""
    env = os.environ if env is None else env
    return XpuSource(
        xpu_smi=env.get(XPU_SMI_ENV) or "xpu-smi",
        root=env.get(DEV_ROOT_ENV) or "/",
        kml_version_file=env.get(KML_VERSION_FILE_ENV, DEFAULT_KML_VERSION_FILE) or None,
    )


@dataclass(frozen=True, slots=True)
class KunlunStack:
    """What the probe found: the pieces of Kunlun software this host has."""

    xpu_smi: str  # the command as configured
    xpu_smi_found: bool
    torch_extension: str | None  # the first of TORCH_EXTENSION_MODULES that is installed

    @property
    def missing(self) -> tuple[str, ...]:
        """Human-readable names of what is missing (empty when the stack is complete)."""
        missing = []
        if self.torch_extension is None:
            names = " or ".join(TORCH_EXTENSION_MODULES)
            missing.append(f"Kunlun's PyTorch build (Python module {names})")
        if not self.xpu_smi_found:
            missing.append(f"xpu-smi ({self.xpu_smi!r} not found; set {XPU_SMI_ENV})")
        return tuple(missing)


def probe_stack(
    env: Mapping[str, str] | None = None,
    find_module: Callable[[str], bool] | None = None,
) -> KunlunStack:
    """Look for the Kunlun software stack without importing or running anything.

    Args:
        env: environment to read ``KUNLUN_XPU_SMI`` from (default ``os.environ``).
        find_module: whether a Python module is installed (default: ``importlib.util.find_spec``).
    """
    env = os.environ if env is None else env
    find = find_module or (lambda name: importlib.util.find_spec(name) is not None)
    xpu_smi = env.get(XPU_SMI_ENV) or "xpu-smi"
    extension = next((name for name in TORCH_EXTENSION_MODULES if find(name)), None)
    return KunlunStack(xpu_smi, shutil.which(xpu_smi) is not None, extension)


class KunlunPlatform(Platform):
    """One local rank on Kunlun XPUs.

    Args:
        source: where ``xpu-smi`` and the host files are (default: from the environment).
        local_index: this process's card among the visible ones (its torch device index).
        env: environment for ``XPU_VISIBLE_DEVICES`` (default ``os.environ``).
    """

    name = "kunlun"
    # L2 line of the XPU as the allocator sees it; not yet measured on a P800 (64 B is the safe
    # common value: aligning to a multiple of the real line would still be aligned).
    cache_line_bytes = 64
    # Kunlun's PyTorch build routes the "nccl" process-group backend to XCCL (as vLLM-Kunlun uses it).
    distributed_backend = "nccl"

    def __init__(
        self, source: XpuSource | None = None, local_index: int = 0, env: Mapping[str, str] | None = None
    ) -> None:
        self.device_type = torch_device_type()
        self.source = source if source is not None else source_from_env(env)
        self.local_index = local_index
        self.visible = visible_card_indices(env)

    def device(self, index: int | None = None) -> torch.device:
        """The torch device of local rank ``index`` (default: this platform's rank)."""
        return torch.device(self.device_type, self.local_index if index is None else index)

    def host_index(self, local_index: int | None = None) -> int:
        """The host card index (``xpu-smi`` index, ``/dev/xpuN``) of a local rank."""
        local = self.local_index if local_index is None else local_index
        if self.visible is None:
            return local
        if not 0 <= local < len(self.visible):
            raise ConfigError(
                f"device: local rank {local} but {VISIBLE_DEVICES_ENV} lists {len(self.visible)} cards",
                field="device",
            )
        return self.visible[local]

    def num_cards(self) -> int:
        """Cards this process may use: those in ``XPU_VISIBLE_DEVICES``, else all that xpu-smi lists."""
        if self.visible is not None:
            return len(self.visible)
        try:
            return len(self.source.telemetry().cards)
        except XpuError as error:
            raise ConfigError(f"device: cannot count the Kunlun cards: {error}", field="device") from error

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.float32, torch.bfloat16, torch.float16)

    def telemetry(self) -> Telemetry:
        """This rank's card from the ``xpu-smi`` summary; all ``None`` when the tool fails."""
        try:
            table = self.source.telemetry()
        except XpuError as error:
            logger.warning("kunlun telemetry unavailable: %s", error)
            return Telemetry()
        index = self.host_index()
        card = next((card for card in table.cards if card.index == index), None)
        if card is None:
            logger.warning("kunlun telemetry: xpu-smi does not list card %d", index)
            return Telemetry()
        return Telemetry(
            utilization_ratio=card.utilization_ratio,
            memory_used_bytes=card.memory_used_bytes,
            memory_total_bytes=card.memory_total_bytes,
            temperature_celsius=card.temperature_celsius,
            power_watts=card.power_watts,
        )

    def total_memory_bytes(self) -> int:
        return self._memory()[1]

    def free_memory_bytes(self) -> int:
        used, total = self._memory()
        return total - used

    def _memory(self) -> tuple[int, int]:
        reading = self.telemetry()
        if reading.memory_total_bytes is None or reading.memory_used_bytes is None:
            raise ConfigError(
                f"device: cannot read the memory of card {self.host_index()} from xpu-smi "
                f"({self.source.xpu_smi})",
                field="device",
            )
        return reading.memory_used_bytes, reading.memory_total_bytes

    def versions(self) -> Versions:
        """Driver and firmware from ``xpu-smi``, KML as the compute library; None where unknown."""
        try:
            found = self.source.versions()
        except XpuError as error:
            logger.warning("kunlun versions unavailable: %s", error)
            return Versions()
        return Versions(
            driver=found.driver,
            firmware=found.firmware,
            compute_library=None if found.kml is None else f"kml-{found.kml}",
        )

    def set_device(self, local_rank: int) -> None:
        """Bind this process to the card of ``local_rank``: Kunlun's PyTorch build selects it through
        ``torch.cuda.set_device`` (its cards are ``cuda`` devices); telemetry follows that card."""
        self._device_module().set_device(local_rank)
        self.local_index = local_rank

    def current_device_index(self) -> int | None:
        return int(self._device_module().current_device())

    @staticmethod
    def _device_module() -> Any:
        """The torch module of ``torch_device_type()`` (``torch.cuda`` in Kunlun's build)."""
        return getattr(torch, torch_device_type())

    def synchronize(self) -> None:
        torch.cuda.synchronize()

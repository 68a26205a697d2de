"""What this CPU can run, read once: its ISA tier and the cache sizes the kernels tune to.

Every automatic choice on CPU (compute dtype, linear backend, our kernels, attention path, INT8
path) resolves against ``cpu_capabilities()`` and never picks what the tier cannot run. The tiers,
best first:

- ``amx``: AVX-512 BF16 plus AMX tiles (Sapphire Rapids and later).
- ``avx512``: AVX-512 F/BW/VL/DQ with BF16 dot products and VNNI (Zen 4/5, Cooper Lake).
- ``avx2``: AVX2 + FMA + F16C (Haswell on, every Zen, Hygon); BF16 is only emulated here, so the
  runtime computes in FP32 and keeps weights in BF16 or INT8.
- ``none``: anything else, aarch64 included: plain PyTorch.

``KUNLUN_CPU_ISA=<tier>`` runs a lower tier than the CPU has (tests run the AVX2 tier on AVX-512
machines); asking for a tier the CPU lacks is a ConfigError naming the missing flags.
"""

from __future__ import annotations

import enum
import functools
import logging
import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kunlun_runtime.errors import ConfigError

log = logging.getLogger(__name__)

ISA_ENV = "KUNLUN_CPU_ISA"


class IsaTier(enum.Enum):
    NONE = "none"
    AVX2 = "avx2"
    AVX512 = "avx512"
    AMX = "amx"

    @property
    def rank(self) -> int:
        return _RANKS[self]

    def __ge__(self, other: IsaTier) -> bool:
        return self.rank >= other.rank


_RANKS = {IsaTier.NONE: 0, IsaTier.AVX2: 1, IsaTier.AVX512: 2, IsaTier.AMX: 3}
# /proc/cpuinfo flags each tier needs on top of the tier below it.
TIER_FLAGS: dict[IsaTier, tuple[str, ...]] = {
    IsaTier.NONE: (),
    IsaTier.AVX2: ("avx2", "fma", "f16c"),
    IsaTier.AVX512: ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"),
    IsaTier.AMX: ("amx_tile", "amx_bf16"),
}


@dataclass(frozen=True, slots=True)
class CpuCapabilities:
    """The tier in force, the best one the CPU has, and its caches (None where unknown)."""

    tier: IsaTier
    detected_tier: IsaTier
    model_name: str
    flags: frozenset[str]
    l1d_bytes: int | None
    l2_bytes: int | None
    l3_bytes: int | None

    @property
    def computes_bf16(self) -> bool:
        """Whether BF16 arithmetic is native (not emulated) in the tier in force."""
        return self.tier >= IsaTier.AVX512

    def summary(self) -> str:
        """One line for logs: the CPU, the tier in force and, when forced, the one detected."""
        forced = ""
        if self.tier != self.detected_tier:
            forced = f" (forced by {ISA_ENV}; the CPU has {self.detected_tier.value})"
        return f"CPU {self.model_name}: ISA tier {self.tier.value}{forced}"

    def describe(self) -> dict[str, object]:
        """A JSON-ready summary (``--version``, ``/version``, ``tune``'s record)."""
        return {
            "isa_tier": self.tier.value,
            "detected_isa_tier": self.detected_tier.value,
            "model_name": self.model_name,
            "l1d_bytes": self.l1d_bytes,
            "l2_bytes": self.l2_bytes,
            "l3_bytes": self.l3_bytes,
        }


def missing_flags(tier: IsaTier, flags: frozenset[str]) -> list[str]:
    """The flags ``tier`` needs (its own and every lower tier's) that ``flags`` lacks."""
    needed = [flag for other in IsaTier if tier >= other for flag in TIER_FLAGS[other]]
    return [flag for flag in needed if flag not in flags]


def best_tier(flags: frozenset[str], machine: str) -> IsaTier:
    if machine not in ("x86_64", "AMD64"):
        return IsaTier.NONE
    best = IsaTier.NONE
    for tier in (IsaTier.AVX2, IsaTier.AVX512, IsaTier.AMX):
        if missing_flags(tier, flags):
            break
        best = tier
    return best


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first processor in /proc/cpuinfo's text."""
    model, flags = "unknown", frozenset[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown":
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
    return model, flags


def read_cache_bytes(sysfs_root: Path) -> dict[str, int]:
    """Per-core L1d and L2 and the L3 of cpu0, from sysfs (``{"L1d": …, "L2": …, "L3": …}``)."""
    sizes: dict[str, int] = {}
    for index in sorted((sysfs_root / "devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        if kind == "Instruction":
            continue
        multiplier = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(size[-1:], 1)
        try:
            sizes["L1d" if level == "1" else f"L{level}"] = int(size.rstrip("KMG")) * multiplier
        except ValueError:
            continue
    return sizes


def probe(
    cpuinfo_text: str,
    machine: str,
    env: Mapping[str, str],
    cache_bytes: Mapping[str, int] | None = None,
) -> CpuCapabilities:
    """The capabilities from /proc/cpuinfo's text, the machine name and the environment.

    Raises ConfigError when ``KUNLUN_CPU_ISA`` names an unknown tier or one the CPU lacks.
    """
    model, flags = parse_cpuinfo(cpuinfo_text)
    detected = best_tier(flags, machine)
    tier = detected
    requested = env.get(ISA_ENV, "").strip().lower()
    if requested:
        try:
            tier = IsaTier(requested)
        except ValueError:
            raise ConfigError(
                f"{ISA_ENV}: unknown tier {requested!r}; one of {[t.value for t in IsaTier]}", field=ISA_ENV
            ) from None
        if not detected >= tier:
            lacking = (
                missing_flags(tier, flags) if machine in ("x86_64", "AMD64") else [f"x86-64 ({machine})"]
            )
            raise ConfigError(
                f"{ISA_ENV}={requested}: this CPU ({model}) lacks {', '.join(lacking)}; "
                f"its best tier is {detected.value}",
                field=ISA_ENV,
            )
    caches = cache_bytes or {}
    return CpuCapabilities(
        tier=tier,
        detected_tier=detected,
        model_name=model,
        flags=flags,
        l1d_bytes=caches.get("L1d"),
        l2_bytes=caches.get("L2"),
        l3_bytes=caches.get("L3"),
    )


@functools.cache
def cpu_capabilities() -> CpuCapabilities:
    """This process's capabilities, probed once (raises ConfigError for a bad KUNLUN_CPU_ISA)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    capabilities = probe(text, platform.machine(), os.environ, read_cache_bytes(Path("/sys")))
    log.info("%s", capabilities.summary())
    return capabilities

"""Value types describing Kunlun cards: what a card is, what versions it runs, how it is doing.

Invariant: all values are immutable; units are in the field names; `None` means "not reported",
never a zero standing in for a missing reading.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class XpuDevice:
    """One physical card as discovered on the node."""

    index: int  # xpu-smi index == minor number of /dev/xpuN
    uuid: str  # e.g. GPU-420716f2-9928-5108-a5b2-e6b7cf36b37c; the device id given to kubelet
    product: str  # e.g. "P800 OAM"
    memory_total_bytes: int
    bus_id: str  # PCI address as xpu-smi prints it, e.g. 00000000:52:00.0
    numa_node: int | None  # None when neither sysfs nor the topology report it
    device_path: str  # host path of the device node, e.g. /dev/xpu3
    firmware_version: str | None  # "ALL Version" from `xpu-smi -q`


@dataclass(frozen=True, slots=True)
class Versions:
    """Software versions of the node (identical for all cards of a node)."""

    driver: str | None  # e.g. 5.0.21.26; None when no card answers
    runtime: str | None  # XPU-RT version, e.g. 5.0.21
    firmware: str | None  # the cards' firmware ("ALL Version"), None if no card or cards disagree
    kml: str | None  # KML compute library, None when its configured source has none


@dataclass(frozen=True, slots=True)
class CardTelemetry:
    """One card's readings from the `xpu-smi` summary table."""

    index: int
    product: str
    bus_id: str
    temperature_celsius: float | None
    power_watts: float | None
    power_limit_watts: float | None
    memory_used_bytes: int
    memory_total_bytes: int
    utilization_ratio: float  # 0.0 .. 1.0
    ecc_uncorrectable_errors: int | None  # "Volatile Uncorr. ECC"; None when N/A


@dataclass(frozen=True, slots=True)
class SmiTable:
    """The whole `xpu-smi` summary: versions from the header and one entry per card."""

    driver_version: str
    runtime_version: str
    cards: tuple[CardTelemetry, ...]


@dataclass(frozen=True, slots=True)
class CardDetail:
    """Per-card detail from `xpu-smi -q --id=N` (only the fields this package uses)."""

    index: int  # Minor Number
    uuid: str
    product: str
    bus_id: str
    firmware_version: str | None
    memory_total_bytes: int
    ecc_correctable_errors: int | None
    ecc_uncorrectable_errors: int | None


@dataclass(frozen=True, slots=True)
class ListedCard:
    """One line of `xpu-smi -L`."""

    index: int
    product: str
    uuid: str


@dataclass(frozen=True, slots=True)
class Topology:
    """Card-to-card links and NUMA affinity from `xpu-smi topo -m`.

    `links[(a, b)]` is the link kind between cards a and b (a != b), e.g. "XL" (XPU Link),
    "PIX", "NODE", "SYS"; the mapping is symmetric.
    """

    links: dict[tuple[int, int], str]
    numa_nodes: dict[int, int]  # card index -> NUMA node ("NUMA Affinity" column)

    def linked(self, a: int, b: int) -> bool:
        """True when cards a and b share a direct XPU link."""
        return self.links.get((a, b)) == "XL"

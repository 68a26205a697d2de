"""Which NUMA node each card sits on: sysfs first, then `xpu-smi topo -m`, else unknown.

The topology is optional: some `xpu-smi` builds have no `topo -m`, others print it in a layout
`parse_smi_topo` does not know. Such a node still has usable cards; only their NUMA node is unknown,
so they are offered to kubelet without topology and allocated without a NUMA preference.

Invariant: `resolve_numa` never raises an `XpuError` and never guesses a node: a card whose node no
source reports gets None, and the result says why.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kunlun_device.errors import XpuError
from kunlun_device.xpu.model import Topology

NO_SYSFS = "sysfs has no numa_node for them"


@dataclass(frozen=True, slots=True)
class NumaProbe:
    """The outcome of looking up every card's NUMA node."""

    numa_nodes: dict[int, int | None]  # card index -> NUMA node; None: unknown
    unknown_reason: str | None  # why some nodes are unknown; None when every card's node is known

    @property
    def unknown_ids(self) -> tuple[int, ...]:
        """Indices of the cards whose NUMA node is unknown, ascending."""
        return tuple(sorted(index for index, node in self.numa_nodes.items() if node is None))


def resolve_numa(sysfs_numa: Mapping[int, int | None], read_topology: Callable[[], Topology]) -> NumaProbe:
    """Complete the NUMA nodes sysfs reports with those of the topology matrix.

    Args:
        sysfs_numa: card index -> NUMA node from sysfs (None where sysfs has none).
        read_topology: reads `xpu-smi topo -m`; called only when sysfs lacks a card.
    Returns:
        Every card's node, None where neither source reports one, with the reason.
    """
    numa_nodes = dict(sysfs_numa)
    missing = sorted(index for index, node in numa_nodes.items() if node is None)
    if not missing:
        return NumaProbe(numa_nodes, None)
    try:
        topology = read_topology()
    except XpuError as exc:  # no `topo -m`, another layout, a timeout: topology is optional
        return NumaProbe(numa_nodes, f"{NO_SYSFS} and the topology is unusable: {exc}")
    numa_nodes |= {index: topology.numa_nodes.get(index) for index in missing}
    if all(numa_nodes[index] is not None for index in missing):
        return NumaProbe(numa_nodes, None)
    return NumaProbe(numa_nodes, f"{NO_SYSFS} and xpu-smi topo -m reports no NUMA Affinity for them")

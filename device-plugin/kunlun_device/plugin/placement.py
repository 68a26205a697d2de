"""Where each card sits: its NUMA node and its XPU Link peers, as the allocator needs them.

Built once from discovery (`XpuDevice.numa_node`) and `xpu-smi topo -m`. When a node reports no
NUMA node for its cards, 8-card P800 nodes fall back to the known layout (cards 0-3 and 4-7 are the
two halves); other nodes treat all cards as one group. Without a topology, cards of the same group
count as linked.

Invariant: every card has a group (an int) and `linked` is symmetric.
"""

from __future__ import annotations

from dataclasses import dataclass

from kunlun_device.xpu.model import Topology, XpuDevice

P800_HALF = 4


@dataclass(frozen=True, slots=True)
class CardPlace:
    """One card as the allocator sees it."""

    device_id: str
    index: int
    group: int  # NUMA node, or the fallback group
    numa_node: int | None = None  # the NUMA node the node reports (None: unknown, not told to kubelet)


@dataclass(frozen=True, slots=True)
class Placement:
    """All cards of the node and which pairs share an XPU Link."""

    cards: tuple[CardPlace, ...]
    linked_pairs: frozenset[frozenset[int]]  # pairs of card indices

    def by_id(self) -> dict[str, CardPlace]:
        return {card.device_id: card for card in self.cards}

    def linked(self, a: int, b: int) -> bool:
        return frozenset((a, b)) in self.linked_pairs


def _numa(device: XpuDevice, topology: Topology | None) -> int | None:
    if device.numa_node is not None:
        return device.numa_node
    if topology is not None:
        return topology.numa_nodes.get(device.index)
    return None


def _group(device: XpuDevice, devices: tuple[XpuDevice, ...], topology: Topology | None) -> int:
    numa = _numa(device, topology)
    if numa is not None:
        return numa
    if len(devices) == 2 * P800_HALF and device.product.startswith("P800"):
        return device.index // P800_HALF
    return 0


def build_placement(devices: tuple[XpuDevice, ...], topology: Topology | None) -> Placement:
    """Combine discovery and topology into a `Placement`."""
    cards = tuple(
        CardPlace(d.uuid, d.index, _group(d, devices, topology), _numa(d, topology)) for d in devices
    )
    pairs: set[frozenset[int]] = set()
    for a in cards:
        for b in cards:
            if a.index >= b.index:
                continue
            if topology is not None and topology.links:
                if topology.linked(a.index, b.index):
                    pairs.add(frozenset((a.index, b.index)))
            elif a.group == b.group:
                pairs.add(frozenset((a.index, b.index)))
    return Placement(cards=cards, linked_pairs=frozenset(pairs))

"""XPU Link groups: which cards a tensor-parallel claim may take together (`linkGroup`).

A group is a set of cards that are all pairwise linked, so that a claim whose devices share a
`linkGroup` (`matchAttribute`) gets an all-to-all interconnect. Groups are formed greedily in card
order: the lowest card not yet grouped opens a group, and every later ungrouped card linked to all
members joins it. On an 8-card P800 node (two fully linked quads, with one link between partner
cards of the two quads) that gives cards 0-3 group 0 and 4-7 group 1. Links come from the classic
plugin's `Placement`: the `xpu-smi topo -m` matrix, or without one its fallback (cards of one NUMA
node, or the two halves of an 8-card P800, count as linked), which the caller logs.

Invariant: pure; every card gets exactly one group, numbered 0, 1, ... in order of its lowest card.
"""

from __future__ import annotations

from kunlun_device.plugin.placement import Placement


def link_groups(placement: Placement) -> dict[int, int]:
    """Card index -> link group number (see the module docstring)."""
    groups: list[list[int]] = []
    for index in sorted(card.index for card in placement.cards):
        for members in groups:
            if all(placement.linked(index, member) for member in members):
                members.append(index)
                break
        else:
            groups.append([index])
    return {index: number for number, members in enumerate(groups) for index in members}

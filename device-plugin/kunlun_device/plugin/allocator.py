"""Topology-aware choice of cards for `GetPreferredAllocation`.

Among all subsets of the available cards that have the requested size and contain the must-include
cards, pick the best by, in order:
1. fewest NUMA groups (1, 2 and 4 cards stay inside one half of a P800 node when possible);
2. fewest card pairs without an XPU Link (tensor-parallel groups on linked cards);
3. least fragmentation: fewest free cards in the groups touched (best fit, so partly used halves
   fill up first and whole halves stay free for large requests);
4. lowest card indices (deterministic).
Nodes have at most a few dozen cards; beyond `MAX_CANDIDATES` subsets a greedy fill is used.

Invariant: the answer always has exactly `size` distinct ids, all available or must-include, and
contains every must-include id; impossible requests raise instead of returning something else.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Iterator
from itertools import combinations

from kunlun_device.errors import AllocationError, UnknownDeviceError
from kunlun_device.plugin.placement import CardPlace, Placement

MAX_CANDIDATES = 20_000


def _score(
    chosen: tuple[CardPlace, ...], free_per_group: Counter[int], placement: Placement
) -> tuple[int, int, int, list[int]]:
    groups = {card.group for card in chosen}
    unlinked = sum(1 for a, b in combinations(chosen, 2) if not placement.linked(a.index, b.index))
    fit = sum(free_per_group[group] for group in groups)
    return (len(groups), unlinked, fit, sorted(card.index for card in chosen))


def _greedy(must: list[CardPlace], rest: list[CardPlace], count: int, free: Counter[int]) -> list[CardPlace]:
    must_groups = {card.group for card in must}
    rest = sorted(rest, key=lambda c: (c.group not in must_groups, -free[c.group], c.group, c.index))
    return must + rest[:count]


def preferred_allocation(
    placement: Placement, available_ids: Iterable[str], must_include_ids: Iterable[str], size: int
) -> list[str]:
    """Choose `size` device ids.

    Returns:
        The chosen ids, ordered by card index.
    Raises:
        UnknownDeviceError: an id that is not a card of this node.
        AllocationError: `size` smaller than the must-include set or larger than what is free.
    """
    cards = placement.by_id()
    available, must = list(dict.fromkeys(available_ids)), list(dict.fromkeys(must_include_ids))
    unknown = [i for i in [*available, *must] if i not in cards]
    if unknown:
        raise UnknownDeviceError(sorted(set(unknown)))
    free_ids = list(dict.fromkeys([*must, *available]))
    if size < max(1, len(must)) or size > len(free_ids):
        raise AllocationError(
            f"allocation_size {size} impossible with {len(must)} must-include and {len(free_ids)} free cards"
        )
    free = Counter(cards[i].group for i in free_ids)
    must_cards = [cards[i] for i in must]
    rest = sorted((cards[i] for i in free_ids if i not in set(must)), key=lambda c: c.index)
    count = size - len(must_cards)
    if math.comb(len(rest), count) > MAX_CANDIDATES:
        chosen = _greedy(must_cards, rest, count, free)
    else:
        candidates: Iterator[tuple[CardPlace, ...]] = (
            tuple(must_cards) + extra for extra in combinations(rest, count)
        )
        best = min(candidates, key=lambda c: _score(c, free, placement))
        chosen = list(best)
    return [card.device_id for card in sorted(chosen, key=lambda c: c.index)]

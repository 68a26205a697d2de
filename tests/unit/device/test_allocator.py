"""GetPreferredAllocation choices: table-driven cases on the 8-card P800 fixture, and properties."""

from __future__ import annotations

from dataclasses import replace
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kunlun_device.errors import AllocationError, UnknownDeviceError
from kunlun_device.plugin.allocator import preferred_allocation
from kunlun_device.plugin.placement import CardPlace, Placement, build_placement
from tests.unit.device.hosts import make_source


@cache
def p800() -> Placement:
    source = make_source("p800-8")
    return build_placement(source.list_devices(), source.topology())


def ids(*indices: int) -> list[str]:
    by_index = {card.index: card.device_id for card in p800().cards}
    return [by_index[i] for i in indices]


def indices(device_ids: list[str]) -> list[int]:
    by_id = p800().by_id()
    return [by_id[i].index for i in device_ids]


@pytest.mark.parametrize(
    ("free", "must", "size", "expected"),
    [
        (range(8), [], 1, [0]),
        (range(8), [], 2, [0, 1]),
        (range(8), [], 4, [0, 1, 2, 3]),
        (range(8), [], 8, list(range(8))),
        # best fit: half 4-7 is partly used, so a small request goes there and keeps 0-3 whole
        ([0, 1, 2, 3, 6, 7], [], 2, [6, 7]),
        ([0, 1, 2, 3, 5, 6, 7], [], 1, [5]),
        # a 4-card request cannot fit the broken half: it takes the whole free half
        ([0, 1, 2, 3, 5, 6, 7], [], 4, [0, 1, 2, 3]),
        # must-include card 5 keeps the request in half 4-7
        (range(8), [5], 2, [4, 5]),
        # no half has 3 free cards: two halves, preferring linked pairs (1-5 and 2-6 cross links)
        ([1, 2, 5, 6], [], 3, [1, 2, 5]),
        # must-include cards in both halves: spans them
        (range(8), [0, 7], 2, [0, 7]),
    ],
)
def test_p800_choices(free: list[int], must: list[int], size: int, expected: list[int]) -> None:
    assert indices(preferred_allocation(p800(), ids(*free), ids(*must), size)) == expected


def test_unknown_ids_are_named() -> None:
    with pytest.raises(UnknownDeviceError, match="unknown device ids: GPU-nope, GPU-zzz"):
        preferred_allocation(p800(), [*ids(0, 1), "GPU-zzz"], ["GPU-nope"], 1)


@pytest.mark.parametrize(("must", "size"), [([0, 1], 1), ([], 9), ([], 0)])
def test_impossible_sizes_are_errors(must: list[int], size: int) -> None:
    with pytest.raises(AllocationError, match=f"allocation_size {size} impossible"):
        preferred_allocation(p800(), ids(*range(8)), ids(*must), size)


def test_without_topology_p800_halves_come_from_indices() -> None:
    devices = make_source("p800-8").list_devices()
    unknown_numa = tuple(replace(d, numa_node=None) for d in devices)
    placement = build_placement(unknown_numa, None)
    assert [card.group for card in placement.cards] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [card.numa_node for card in placement.cards] == [None] * 8  # never reported to kubelet
    chosen = preferred_allocation(placement, [c.device_id for c in placement.cards[2:]], [], 2)
    assert [placement.by_id()[i].index for i in chosen] == [2, 3]


def placements() -> st.SearchStrategy[Placement]:
    """Random nodes of 1-12 cards in 1-3 NUMA groups with random XPU Links."""

    @st.composite
    def build(draw: st.DrawFn) -> Placement:
        count = draw(st.integers(1, 12))
        groups = draw(st.lists(st.integers(0, 2), min_size=count, max_size=count))
        cards = tuple(CardPlace(f"GPU-{i:02d}", i, g) for i, g in enumerate(groups))
        pairs = [frozenset((a, b)) for a in range(count) for b in range(a + 1, count)]
        linked = draw(st.sets(st.sampled_from(pairs))) if pairs else set()
        return Placement(cards=cards, linked_pairs=frozenset(linked))

    return build()


@st.composite
def requests(draw: st.DrawFn) -> tuple[Placement, list[str], list[str], int]:
    placement = draw(placements())
    all_ids = [c.device_id for c in placement.cards]
    available = draw(st.lists(st.sampled_from(all_ids), min_size=1, unique=True))
    must = draw(st.lists(st.sampled_from(available), unique=True, max_size=len(available)))
    size = draw(st.integers(max(1, len(must)), len(available)))
    return placement, available, must, size


@settings(max_examples=300, deadline=None)
@given(requests())
def test_property_valid_subset_with_must_include_and_numa_local(
    request: tuple[Placement, list[str], list[str], int],
) -> None:
    placement, available, must, size = request
    chosen = preferred_allocation(placement, available, must, size)
    assert len(chosen) == size == len(set(chosen))
    assert set(chosen) <= set(available) | set(must)
    assert set(must) <= set(chosen)
    cards = placement.by_id()
    groups = {cards[i].group for i in chosen}
    must_groups = {cards[i].group for i in must}
    local_possible = any(
        len(must_groups - {g}) == 0 and sum(cards[i].group == g for i in available) >= size
        for g in {c.group for c in placement.cards}
    )
    if local_possible:
        assert len(groups) == 1, f"{chosen} spans groups {groups} although one group could hold it"

"""What a ``dra`` service asks fits what the DRA plugin publishes: the claim templates the operator
builds, evaluated (cel-python, ``dra_cel``) against ResourceSlices made by the plugin's own
``build_resource_slice`` from the fixture hosts. Certified cards match; a card with another
firmware, or without a version the plugin could publish, does not; a tensor-parallel claim is met
only inside one XPU Link group; the operator's own explanation agrees with the CEL on every card.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kunlun_device.dra.links import link_groups
from kunlun_device.dra.slices import build_resource_slice
from kunlun_device.plugin.placement import build_placement
from kunlun_operator.builders.resource_claim import versions_selector
from kunlun_operator.decide.allocation import claim_stacks, claim_template, mismatch, parse_slice_devices
from kunlun_operator.policy.matrix import CertifiedStack, load_default_matrix
from kunlun_operator.spec.service import parse_spec
from kunlun_operator.spec.values import InferenceSpec
from tests.unit.device.hosts import make_source
from tests.unit.operator.dra_cel import allocatable_sets, matching_devices, selects
from tests.unit.operator.factories import make_raw_spec, make_ref

IMAGE = "ghcr.io/kunlun-inference/kunlun-runtime:0.1.0-kunlun"
OTHER_FIRMWARE = "1.0.2.14.1.50"


def node_slice(
    host: str = "p800-8", *, firmware: dict[int, str] | None = None, **kwargs: Any
) -> dict[str, Any]:
    """The slice the plugin publishes for fixture ``host``; ``firmware``: card index -> another
    firmware (a node whose cards were flashed unevenly)."""
    source = make_source(host)
    devices = source.list_devices()
    groups = link_groups(build_placement(devices, source.topology()))
    versions = source.versions(devices)
    devices = [
        dataclasses.replace(d, firmware_version=(firmware or {}).get(d.index, d.firmware_version))
        for d in devices
    ]
    return build_resource_slice("node-a", devices, versions, link_groups=groups, **kwargs)


def dra_spec(**resources: Any) -> InferenceSpec:
    tp = resources.pop("tp", 1)
    return parse_spec(
        make_raw_spec(
            resources={"allocation": "dra", **resources},
            runtime={"tensorParallelSize": tp},
        )
    )


def claim_spec(spec: InferenceSpec) -> dict[str, Any]:
    template = claim_template(make_ref(), spec, load_default_matrix(), IMAGE)
    assert template is not None
    return template["spec"]["spec"]


def request(spec: InferenceSpec) -> dict[str, Any]:
    return claim_spec(spec)["devices"]["requests"][0]["exactly"]


def test_the_certified_cards_of_the_fixture_node_all_match() -> None:
    assert matching_devices(request(dra_spec()), node_slice()) == [f"xpu-{i}" for i in range(8)]


def test_a_card_with_another_firmware_does_not_match() -> None:
    mixed = node_slice(firmware={6: OTHER_FIRMWARE, 7: OTHER_FIRMWARE})
    assert matching_devices(request(dra_spec()), mixed) == [f"xpu-{i}" for i in range(6)]


def test_a_card_whose_firmware_the_plugin_could_not_publish_does_not_match_and_nothing_aborts() -> None:
    # the plugin leaves out a version it cannot map to semver; has() keeps the selector a boolean
    unpublished = node_slice(firmware={0: "weird firmware"})
    assert "firmwareVersion" not in unpublished["spec"]["devices"][0]["attributes"]
    assert matching_devices(request(dra_spec()), unpublished) == [f"xpu-{i}" for i in range(1, 8)]


def test_other_locked_versions_match_no_card_of_the_node() -> None:
    spec = dataclasses.replace(dra_spec(), versions=dataclasses.replace(dra_spec().versions, kml="3.2.1"))
    stacks = (CertifiedStack(("5.0.21.26",), ("1.0.2.14.1.54",), ("3.2.1",)),)
    expression = versions_selector(stacks)
    assert expression is not None
    assert matching_devices({"selectors": [{"cel": {"expression": expression}}]}, node_slice()) == []
    devices = parse_slice_devices([node_slice()])
    assert {mismatch(d, spec, stacks) for d in devices} == {"kmlVersion 3.2.1"}


def test_a_selector_over_two_certified_stacks_is_their_or() -> None:
    stacks = (
        CertifiedStack(("5.0.21.26",), ("1.0.2.14.1.54",), ("3.2.0",)),
        CertifiedStack(("5.0.21.26",), (OTHER_FIRMWARE,), ("3.2.0",)),
    )
    expression = versions_selector(stacks)
    assert expression is not None
    mixed = node_slice(firmware={6: OTHER_FIRMWARE, 7: "1.0.2.14.1.99"})
    selected = matching_devices({"selectors": [{"cel": {"expression": expression}}]}, mixed)
    assert selected == [f"xpu-{i}" for i in range(7)]


def test_newer_and_older_driver_builds_compare_as_different_versions() -> None:
    expression = versions_selector((CertifiedStack(("5.0.21.27",), ("1.0.2.14.1.54",), ("3.2.0",)),))
    assert expression is not None
    device = node_slice()["spec"]["devices"][0]  # driver 5.0.21.26 -> semver 5.0.21-26
    assert not selects(expression, "xpu.kunlun.dev", device)


@pytest.mark.parametrize(("product", "matches"), [("P800-OAM", True), ("P800", False), ("R300", False)])
def test_the_product_selector_compares_the_models_label_safe_form(product: str, matches: bool) -> None:
    names = matching_devices(request(dra_spec(xpuProduct=product)), node_slice())
    assert names == ([f"xpu-{i}" for i in range(8)] if matches else [])


def test_a_tensor_parallel_claim_is_met_only_inside_one_link_group() -> None:
    spec = claim_spec(dra_spec(xpus=2, tp=2))
    assert spec["devices"]["constraints"] == [
        {"requests": ["xpus"], "matchAttribute": "xpu.kunlun.dev/linkGroup"}
    ]
    assert allocatable_sets(spec, node_slice()) == [
        ["xpu-0", "xpu-1", "xpu-2", "xpu-3"],
        ["xpu-4", "xpu-5", "xpu-6", "xpu-7"],
    ]
    # one healthy card left in each quad: two matching cards, but no two in one group
    split = node_slice(unhealthy={1, 2, 3, 5, 6, 7})
    assert matching_devices(spec["devices"]["requests"][0]["exactly"], split) == ["xpu-0", "xpu-4"]
    assert allocatable_sets(spec, split) == []
    # without the constraint (one engine per card) the same two cards would do
    assert allocatable_sets(claim_spec(dra_spec(xpus=2)), split) == [["xpu-0", "xpu-4"]]


def test_a_four_card_claim_fits_one_quad_of_a_mixed_node_only_where_it_is_certified() -> None:
    spec = claim_spec(dra_spec(xpus=4, tp=4))
    mixed = node_slice(firmware={6: OTHER_FIRMWARE})
    assert allocatable_sets(spec, mixed) == [["xpu-0", "xpu-1", "xpu-2", "xpu-3"]]


@pytest.mark.parametrize(("xpus", "tp"), [(8, 8), (8, 4), (6, 2)])
def test_a_pod_of_more_cards_than_any_link_group_holds_takes_them_across_groups(xpus: int, tp: int) -> None:
    # an 8-card P800 node is two quads: a linkGroup constraint could never be met by 5+ cards
    spec = claim_spec(dra_spec(xpus=xpus, tp=tp))
    assert "constraints" not in spec["devices"]
    assert allocatable_sets(spec, node_slice()) == [[f"xpu-{i}" for i in range(8)]]


@pytest.mark.parametrize(
    "resources",
    [{}, {"xpuProduct": "P800-OAM"}, {"xpuProduct": "R300"}, {"xpus": 2, "tp": 2}],
)
def test_the_operators_explanation_agrees_with_the_cel_on_every_card(resources: dict[str, Any]) -> None:
    spec = dra_spec(**resources)
    mixed = node_slice(firmware={2: OTHER_FIRMWARE, 5: "weird firmware"})
    by_cel = set(matching_devices(request(spec), mixed))
    stacks = claim_stacks(spec, load_default_matrix(), IMAGE)
    by_operator = {d.name for d in parse_slice_devices([mixed]) if mismatch(d, spec, stacks) is None}
    assert by_cel == by_operator
    assert "xpu-2" not in by_cel and "xpu-5" not in by_cel

"""The DRA ResourceSlice builder: exact manifests, schema-valid for Kubernetes 1.34 and 1.37."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from kunlun_device.dra.links import link_groups
from kunlun_device.dra.semver import SEMVER, to_semver
from kunlun_device.dra.slices import build_resource_slice, memory_quantity, pci_bus_id
from kunlun_device.plugin.placement import build_placement
from kunlun_device.xpu import Versions
from tests.unit.device.hosts import make_source

KUBERNETES_VERSIONS = ("1.34.0", "1.37.0")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("5.0.21.26", "5.0.21-26"),
        ("1.0.2.14.1.54", "1.0.2-14.1.54"),
        ("3.2.0", "3.2.0"),
        ("3.2", "3.2.0"),
        ("5", "5.0.0"),
        ("v1.2.3", "1.2.3"),
        ("05.00.021.007", "5.0.21-7"),
        ("1.2.3-rc.1+build.5", "1.2.3-rc.1+build.5"),
        ("5.0.21.26a", "5.0.21-26a"),
        ("5.0.x.1", None),
        ("5..1", None),
        ("5.0.21_26", None),
        ("", None),
        (None, None),
        ("1.2.3." + "1" * 64, None),
    ],
)
def test_to_semver(text: str | None, expected: str | None) -> None:
    assert to_semver(text) == expected


@given(st.text(alphabet="0123456789.abc-", max_size=30))
def test_to_semver_is_semver_or_none(text: str) -> None:
    value = to_semver(text)
    assert value is None or (SEMVER.match(value) and len(value) <= 64)


def test_driver_builds_keep_their_order_and_differ() -> None:
    # the pre-release part compares numerically part by part: 26 < 27 < 100, all distinct
    assert [to_semver(v) for v in ("5.0.21.26", "5.0.21.27", "5.0.21.100")] == [
        "5.0.21-26",
        "5.0.21-27",
        "5.0.21-100",
    ]


def test_quantities_and_bus_ids() -> None:
    assert [memory_quantity(n) for n in (98304 << 20, 1536 << 20, 1000, 0)] == ["96Gi", "1536Mi", "1000", "0"]
    assert pci_bus_id("00000000:9A:00.0") == "0000:9a:00.0"
    assert pci_bus_id("garbage") is None


def test_link_groups_of_the_p800_quads() -> None:
    source = make_source("p800-8")
    devices = source.list_devices()
    assert link_groups(build_placement(devices, source.topology())) == {i: i // 4 for i in range(8)}


def _p800_slice(**kwargs: Any) -> dict[str, Any]:
    source = make_source("p800-8")
    devices = source.list_devices()
    groups = link_groups(build_placement(devices, source.topology()))
    return build_resource_slice("node-a", devices, source.versions(devices), link_groups=groups, **kwargs)


def test_slice_of_the_fixture_node() -> None:
    manifest = _p800_slice(generation=3, node_uid="uid-1", unhealthy={5, 6})
    assert manifest["metadata"] == {
        "name": "node-a-xpu.kunlun.dev",
        "ownerReferences": [
            {"apiVersion": "v1", "kind": "Node", "name": "node-a", "uid": "uid-1", "controller": True}
        ],
    }
    spec = manifest["spec"]
    assert isinstance(spec, dict)
    assert {k: v for k, v in spec.items() if k != "devices"} == {
        "driver": "xpu.kunlun.dev",
        "nodeName": "node-a",
        "pool": {"name": "node-a", "generation": 3, "resourceSliceCount": 1},
    }
    assert [d["name"] for d in spec["devices"]] == ["xpu-0", "xpu-1", "xpu-2", "xpu-3", "xpu-4", "xpu-7"]
    assert spec["devices"][4] == {
        "name": "xpu-4",
        "attributes": {
            "model": {"string": "P800 OAM"},
            "driverVersion": {"version": "5.0.21-26"},
            "firmwareVersion": {"version": "1.0.2-14.1.54"},
            "kmlVersion": {"version": "3.2.0"},
            "uuid": {"string": "GPU-7c1f0004-5a2b-5c3d-8e4f-012345678904"},
            "pciBusID": {"string": "0000:9a:00.0"},
            "numaNode": {"int": 1},
            "linkGroup": {"int": 1},
        },
        "capacity": {"memory": {"value": "96Gi"}},
    }


def test_unknown_values_are_left_out_not_filled_in() -> None:
    device = make_source("p800-8").list_devices()[0]
    device = dataclasses.replace(device, numa_node=None, firmware_version="weird firmware")
    manifest = build_resource_slice("n", [device], Versions("5.0.21.26", None, None, None))
    spec = manifest["spec"]
    assert sorted(spec["devices"][0]["attributes"]) == ["driverVersion", "model", "pciBusID", "uuid"]
    assert "ownerReferences" not in manifest["metadata"]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_slices_are_valid_kubernetes(version: str) -> None:
    for manifest in (_p800_slice(), _p800_slice(unhealthy=set(range(8)), generation=9, node_uid="u")):
        kubernetes_validate.validate(manifest, version, strict=True)


def test_the_documented_kubectl_output_is_the_builders() -> None:
    """docs/device-plugin.md shows the fixture node's slice; it must be what the plugin publishes."""
    doc = (Path(__file__).resolve().parents[3] / "docs" / "device-plugin.md").read_text()
    section = doc.split("<code>kubectl get resourceslice node-a-xpu.kunlun.dev -o yaml</code>", 1)[1]
    shown = yaml.safe_load(section.split("```yaml\n", 1)[1].split("```", 1)[0])
    uid = shown["metadata"]["ownerReferences"][0]["uid"]
    assert shown == _p800_slice(generation=1, node_uid=uid)

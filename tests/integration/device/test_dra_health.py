"""The DRA plugin's health stream and ResourceSlice follow a card that fails and recovers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import kubernetes_validate
import pytest

from kunlun_device.api import drahealth_v1alpha1_pb2 as hpb
from kunlun_device.dra.slices import build_resource_slice
from tests.integration.device.fake_dra_kubelet import (
    DraNode,
    allocated_resources_status,
    result,
    running_dra_node,
)
from tests.support.waiting import wait_for
from tests.unit.device.hosts import make_source, use_outputs

OTHER_FIRMWARE = "1.0.2.14.1.60"


def mixed_firmware(host: Path) -> None:
    """Card 7 runs another firmware than the other seven."""
    query = host / "outputs" / "query-7.txt"
    query.write_text(query.read_text().replace("1.0.2.14.1.54", OTHER_FIRMWARE))


@pytest.fixture
def node(tmp_path: Path) -> Iterator[DraNode]:
    with running_dra_node(tmp_path, before_start=mixed_firmware) as dra_node:
        yield dra_node


def states(response: hpb.NodeWatchResourcesResponse) -> dict[str, str]:
    assert {d.device.pool_name for d in response.devices} == {"node-a"}
    return {d.device.device_name: hpb.HealthStatus.Name(d.health) for d in response.devices}


def read_until(stream: Iterator[hpb.NodeWatchResourcesResponse], wanted: dict[str, str]) -> dict[str, str]:
    seen = states(next(stream))
    while seen != wanted:  # the stream's own deadline bounds the wait
        seen = states(next(stream))
    return seen


def published(node: DraNode) -> tuple[int, list[str]]:
    spec = node.slice()["spec"]
    return spec["pool"]["generation"], [d["name"] for d in spec["devices"]]


def all_cards(state: str) -> dict[str, str]:
    return {f"xpu-{i}": state for i in range(8)}


@pytest.mark.parametrize("kubernetes_version", ["1.34.0", "1.37.0"])
def test_the_published_slice_is_the_builders_and_valid(node: DraNode, kubernetes_version: str) -> None:
    stored = wait_for(
        lambda: node.kube.objects("resourceslices", "resource.k8s.io"),
        timeout_seconds=20,
        message="the slice",
    )
    (manifest,) = stored
    kubernetes_validate.validate(manifest, kubernetes_version, strict=True)
    source = make_source(node.host.name, node.host.parent)
    devices = source.list_devices()
    assert node.server is not None
    (node_object,) = node.kube.objects("nodes")
    expected = build_resource_slice(
        "node-a",
        devices,
        source.versions(devices),
        generation=1,
        link_groups={i: i // 4 for i in range(8)},
        node_uid=node_object["metadata"]["uid"],
    )
    assert manifest["spec"] == expected["spec"]
    assert manifest["metadata"]["ownerReferences"] == expected["metadata"]["ownerReferences"]
    firmware = {d["name"]: d["attributes"]["firmwareVersion"]["version"] for d in manifest["spec"]["devices"]}
    assert firmware == {**{f"xpu-{i}": "1.0.2-14.1.54" for i in range(7)}, "xpu-7": "1.0.2-14.1.60"}


def test_a_failing_card_leaves_the_slice_and_the_stream_says_so(node: DraNode) -> None:
    assert node.server is not None
    node.kubelet.register()
    assert published(node) == (1, [f"xpu-{i}" for i in range(8)])
    with grpc.insecure_channel(f"unix://{node.server.socket_path}") as channel:
        stream = node.kubelet.watch_health(channel)
        assert states(next(stream)) == all_cards("HEALTHY")

        use_outputs(node.host, "p800-failing")  # card 5: uncorrectable ECC; /dev/xpu6 removed
        read_until(stream, {**all_cards("HEALTHY"), "xpu-5": "UNHEALTHY", "xpu-6": "UNHEALTHY"})
        healthy = [f"xpu-{i}" for i in (0, 1, 2, 3, 4, 7)]
        failed_generation, _ = wait_for(
            lambda: (g := published(node))[1] == healthy and g, timeout_seconds=20, message="5, 6 withdrawn"
        )
        assert failed_generation > 1
        claim = node.make_claim("on-5", [result("xpu-5")])
        error = node.kubelet.prepare([claim]).claims[claim[2]].error
        assert (
            error
            == f"claim ml/on-5 ({claim[2]}): device xpu-5 (GPU-7c1f0005-5a2b-5c3d-8e4f-012345678905) is unhealthy"
        )

        use_outputs(node.host, "p800-8")
        read_until(stream, all_cards("HEALTHY"))
        generation, names = wait_for(
            lambda: (g := published(node))[1] == [f"xpu-{i}" for i in range(8)] and g,
            timeout_seconds=20,
            message="5, 6 back",
        )
        assert generation > failed_generation
        assert node.kubelet.prepare([claim]).claims[claim[2]].error == ""  # kubelet's retry succeeds

        use_outputs(node.host, "garbage")  # xpu-smi unreadable: health unknown, the slice stays
        read_until(stream, all_cards("UNKNOWN"))
        assert published(node) == (generation, names)
        stream.cancel()


def test_kubelet_puts_the_streamed_health_on_the_claims_cards(node: DraNode) -> None:
    """The pool and device names streamed are those prepare returned, so kubelet finds each card's
    health; it names the entry after the pod's claim and the card by its CDI id (what the operator's
    fault response reads)."""
    assert node.server is not None
    node.kubelet.register()
    claim = node.make_claim("tp2", [result("xpu-4", "tp"), result("xpu-5", "tp")])
    prepared = node.kubelet.prepare([claim]).claims[claim[2]]
    with grpc.insecure_channel(f"unix://{node.server.socket_path}") as channel:
        stream = node.kubelet.watch_health(channel)
        health = next(stream)
        assert allocated_resources_status("xpus", "", prepared, health) == [
            {
                "name": "claim:xpus",
                "resources": [
                    {"resourceID": f"kunlun.dev/xpu={claim[2]}-xpu-{i}", "health": "Healthy"} for i in (4, 5)
                ],
            }
        ]
        use_outputs(node.host, "p800-failing")  # card 5: uncorrectable ECC
        while states(health).get("xpu-5") != "UNHEALTHY":  # the stream's own deadline bounds the wait
            health = next(stream)
        assert allocated_resources_status("xpus", "tp", prepared, health) == [
            {
                "name": "claim:xpus/tp",
                "resources": [
                    {"resourceID": f"kunlun.dev/xpu={claim[2]}-xpu-4", "health": "Healthy"},
                    {"resourceID": f"kunlun.dev/xpu={claim[2]}-xpu-5", "health": "Unhealthy"},
                ],
            }
        ]
        assert allocated_resources_status("xpus", "other", prepared, health) == []
        stream.cancel()

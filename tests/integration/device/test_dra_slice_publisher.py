"""The DRA plugin's ResourceSlice outlives kubelet: deleted (kubelet's start, or after the plugin
unregistered) it is created again; a malformed one in the API is replaced at start."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from tests.integration.device.fake_dra_kubelet import DraNode, running_dra_node
from tests.support.waiting import wait_for

SLICE = "node-a-xpu.kunlun.dev"
ALL_CARDS = [f"xpu-{i}" for i in range(8)]


@pytest.fixture
def node(tmp_path: Path) -> Iterator[DraNode]:
    with running_dra_node(tmp_path) as dra_node:
        yield dra_node


def custom(node: DraNode) -> Any:
    return kubernetes.client.CustomObjectsApi(node.kube.client())


def delete_slice(node: DraNode) -> None:
    custom(node).delete_cluster_custom_object("resource.k8s.io", "v1", "resourceslices", SLICE)


def published(node: DraNode) -> tuple[int, list[str]] | None:
    stored = node.kube.objects("resourceslices", "resource.k8s.io")
    if not stored:
        return None
    (manifest,) = stored
    return manifest["spec"]["pool"]["generation"], [d["name"] for d in manifest["spec"]["devices"]]


def test_a_deleted_slice_is_created_again_by_the_next_round(node: DraNode) -> None:
    assert published(node) == (1, ALL_CARDS)
    delete_slice(node)
    assert wait_for(lambda: published(node), timeout_seconds=20, message="the slice again") == (2, ALL_CARDS)
    delete_slice(node)
    assert wait_for(lambda: published(node), timeout_seconds=20, message="the slice again") == (3, ALL_CARDS)


def test_a_registration_publishes_at_once(node: DraNode) -> None:
    """kubelet deletes the node's slices when it starts, then registers the plugin again: the slice
    comes back then, not a health interval later."""
    node.stop_plugin()
    node.start_plugin(health_interval_seconds=3600)
    assert published(node) == (1, ALL_CARDS)  # a restarted plugin leaves an unchanged slice alone
    delete_slice(node)
    node.kubelet.register()
    assert wait_for(lambda: published(node), timeout_seconds=20, message="the slice again") == (2, ALL_CARDS)


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ({"driver": "xpu.kunlun.dev", "nodeName": "node-a"}, "spec.pool.generation is None"),
        (
            {"pool": {"name": "node-a", "generation": "7", "resourceSliceCount": 1}, "allNodes": True},
            "spec.pool.generation is '7'",
        ),
    ],
)
def test_a_malformed_slice_is_replaced_at_start(
    node: DraNode, spec: dict[str, Any], problem: str, caplog: pytest.LogCaptureFixture
) -> None:
    node.stop_plugin()
    delete_slice(node)
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": SLICE},
        "spec": spec,
    }
    custom(node).create_cluster_custom_object("resource.k8s.io", "v1", "resourceslices", body)
    with caplog.at_level(logging.ERROR, logger="kunlun_device.dra.kube"):
        server = node.start_plugin()
    assert (
        f"ResourceSlice {SLICE} in the API is malformed ({problem}, expected an integer): replacing it"
        in (caplog.text)
    )
    (manifest,) = node.kube.objects("resourceslices", "resource.k8s.io")
    assert server.publisher is not None
    assert manifest["spec"] == server.build_slice(1, server.publisher.node_uid)["spec"]

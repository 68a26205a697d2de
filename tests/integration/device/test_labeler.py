"""The labeler against the fake Kubernetes API (tests/support/kubeapi.py) on 127.0.0.1."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import kubernetes
import pytest

from kunlun_device.cli import main
from kunlun_device.labeler import NodeLabeler
from tests.support.kubeapi import RunningKubeAPI, running_fake_api
from tests.unit.device.hosts import FIXTURES, copy_host, make_source

P800_LABELS = {
    "kunlun.dev/xpu.present": "true",
    "kunlun.dev/xpu.product": "P800-OAM",
    "kunlun.dev/xpu.count": "8",
    "kunlun.dev/xpu.driver-version": "5.0.21.26",
    "kunlun.dev/xpu.firmware-version": "1.0.2.14.1.54",
    "kunlun.dev/xpu.kml-version": "3.2.0",
}
FOREIGN = {"kubernetes.io/hostname": "n1", "team": "ml", "kunlun.dev/xpu-note": "keep me"}


@pytest.fixture
def kube(tmp_path: Path) -> Iterator[RunningKubeAPI]:
    with running_fake_api(tmp_path) as api:
        core = kubernetes.client.CoreV1Api(api.client())
        core.create_node({"metadata": {"name": "n1", "labels": FOREIGN}})
        yield api


def node_labels(kube: RunningKubeAPI) -> dict[str, str]:
    (node,) = kube.objects("nodes")
    return node["metadata"]["labels"]


def labeler(kube: RunningKubeAPI, host: str, base: Path = FIXTURES) -> NodeLabeler:
    return NodeLabeler(kubernetes.client.CoreV1Api(kube.client()), "n1", make_source(host, base))


def node_calls(kube: RunningKubeAPI) -> list[str]:
    return [verb for verb, _, resource, _ in kube.calls() if resource == "nodes"]


def test_labels_p800_node_and_keeps_foreign_labels(kube: RunningKubeAPI) -> None:
    worker = labeler(kube, "p800-8")
    assert worker.apply() == P800_LABELS
    assert node_labels(kube) == FOREIGN | P800_LABELS
    assert worker.apply() == {}  # already right: read, no patch
    assert node_calls(kube) == ["create", "get", "patch", "get"]


def test_driver_upgrade_changes_only_the_version_label(kube: RunningKubeAPI, tmp_path: Path) -> None:
    host = copy_host("p800-8", tmp_path)
    worker = labeler(kube, "p800-8", tmp_path)
    worker.apply()
    table = host / "outputs" / "table.txt"
    table.write_text(table.read_text().replace("Driver Version: 5.0.21.26", "Driver Version: 5.0.22.3 "))
    assert worker.apply() == {"kunlun.dev/xpu.driver-version": "5.0.22.3"}
    assert node_labels(kube) == FOREIGN | P800_LABELS | {"kunlun.dev/xpu.driver-version": "5.0.22.3"}


@pytest.mark.parametrize("host", ["no-card", "missing-tool"])
def test_node_without_cards_loses_version_labels(kube: RunningKubeAPI, host: str) -> None:
    labeler(kube, "p800-8").apply()
    labeler(kube, host).apply()
    assert node_labels(kube) == FOREIGN | {"kunlun.dev/xpu.present": "false", "kunlun.dev/xpu.count": "0"}


@pytest.mark.parametrize("host", ["p800-no-topo", "p800-topo-pairs"])
def test_node_without_topology_is_labelled_like_any_p800_node(kube: RunningKubeAPI, host: str) -> None:
    assert labeler(kube, host).apply() == P800_LABELS
    assert node_labels(kube) == FOREIGN | P800_LABELS


def test_api_failures_are_retried_with_backoff(kube: RunningKubeAPI) -> None:
    kube.fail("patch", "nodes", status=500, times=3)
    waits: list[float] = []

    def wait(seconds: float) -> bool:
        waits.append(seconds)
        return seconds == 300  # the first regular interval ends the run

    labeler(kube, "p800-8").run(threading.Event(), 300, max_backoff_seconds=3, wait=wait)
    assert waits == [1, 2, 3, 300]
    assert node_labels(kube) == FOREIGN | P800_LABELS


def test_unreadable_xpu_smi_leaves_labels_alone(kube: RunningKubeAPI) -> None:
    labeler(kube, "p800-8").apply()
    waits: list[float] = []
    labeler(kube, "garbage").run(threading.Event(), 300, wait=lambda s: waits.append(s) or len(waits) == 2)
    assert waits == [1, 2]
    assert node_labels(kube) == FOREIGN | P800_LABELS


def test_cli_once(kube: RunningKubeAPI) -> None:
    host = FIXTURES / "p800-8"
    common = ["--xpu-smi", str(host / "xpu-smi"), "--dev-root", str(host / "root"), "--node-name", "n1"]
    assert main(["labeler", "--once", "--kubeconfig", str(kube.kubeconfig), *common]) == 0
    assert node_labels(kube) == FOREIGN | P800_LABELS
    kube.fail("get", "nodes", status=503)
    assert main(["labeler", "--once", "--kubeconfig", str(kube.kubeconfig), *common]) == 1

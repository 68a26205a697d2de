"""Card faults reach the pods: the plugin with its fault responder, the fake kubelet (Registration and
PodResources over real gRPC) and the fake Kubernetes API (real HTTP).

Card 5 of an 8-card P800 node reports uncorrectable ECC errors → the pod holding it gets
`kunlun.dev/xpu-healthy=False` and a Warning Event; the card recovers → True and a Normal Event; a
card failing three times in the window is quarantined (Node annotation, Unhealthy in ListAndWatch
although its checks pass) until the annotation no longer names it.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from kunlun_device.api import deviceplugin_v1beta1_pb2 as pb
from kunlun_device.api import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from kunlun_device.faults import FaultResponder, QuarantinePolicy, read_quarantine_file
from kunlun_device.labels import QUARANTINE_ANNOTATION, UNHEALTHY_TAINT, XPU_HEALTHY_CONDITION
from kunlun_device.plugin import PluginServer
from kunlun_device.podresources import PodResourcesClient
from kunlun_device.xpu.health_tracker import HealthState
from kunlun_device.xpu.model import XpuDevice
from tests.integration.device.fake_kubelet import FakeKubelet, FakePodResources, fast_plugin, short_tempdir
from tests.support.kubeapi import RunningKubeAPI, running_fake_api
from tests.support.waiting import wait_for
from tests.unit.device.hosts import FIXTURES, copy_host

SOCKET = "kunlun-xpu.sock"
BOUND_SECONDS = 10.0  # a change must reach the API within this (rounds are 0.05 s apart)
logger = logging.getLogger(__name__)


def uuid(index: int) -> str:
    return f"GPU-7c1f{index:04x}-5a2b-5c3d-8e4f-0123456789{index:02x}"


@dataclass
class Node:
    host: Path
    kube: RunningKubeAPI
    kubelet: FakeKubelet
    plugin: PluginServer
    quarantine_file: Path

    def responder(self) -> FaultResponder:
        assert isinstance(self.plugin.hook, FaultResponder)
        return self.plugin.hook


def set_table(host: Path, donor: str) -> None:
    """The fixture host's `xpu-smi` summary table becomes `donor`'s (p800-failing: card 5 has ECC errors)."""
    staged = host / "outputs" / ".table.txt.new"
    shutil.copyfile(FIXTURES / donor / "outputs" / "table.txt", staged)
    os.replace(staged, host / "outputs" / "table.txt")


def make_pod(name: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "bank-prod"},
        "spec": {"nodeName": "n1", "containers": [{"name": "runtime", "image": "kunlun-runtime"}]},
    }


@dataclass
class World:
    """What one node's plugin talks to: the fake API (Node n1, pods qwen-0 on cards 4 and 5, qwen-1 on
    card 0), the fake kubelet and its PodResources."""

    kube: RunningKubeAPI
    kubelet_dir: Path
    kubelet: FakeKubelet
    pod_resources: FakePodResources


@contextmanager
def running_world(tmp_path: Path) -> Iterator[World]:
    with running_fake_api(tmp_path) as kube, short_tempdir() as kubelet_dir:
        core = kubernetes.client.CoreV1Api(kube.client())
        core.create_node({"metadata": {"name": "n1"}})
        for name in ("qwen-0", "qwen-1"):
            core.create_namespaced_pod("bank-prod", make_pod(name))
        pod_resources = FakePodResources(kubelet_dir / "pod-resources.sock")
        pod_resources.assignments = {
            ("bank-prod", "qwen-0", "runtime"): [uuid(4), uuid(5)],
            ("bank-prod", "qwen-1", "runtime"): [uuid(0)],
        }
        pod_resources.start()
        kubelet = FakeKubelet(kubelet_dir)
        kubelet.start()
        try:
            yield World(kube, kubelet_dir, kubelet, pod_resources)
        finally:
            kubelet.stop()
            pod_resources.stop()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    host = copy_host("p800-8", tmp_path)
    quarantine_file = tmp_path / "quarantine.json"
    with running_world(tmp_path) as world:
        kube = world.kube

        def respond(devices: tuple[XpuDevice, ...]) -> FaultResponder:
            return FaultResponder(
                devices,
                "n1",
                kubernetes.client.CoreV1Api(kube.client()),
                PodResourcesClient(str(world.pod_resources.socket)),
                QuarantinePolicy(max_failures=3, window_seconds=600),
                taint=True,
                node_sync_seconds=0.05,
                quarantine_file=quarantine_file,
            )

        plugin = fast_plugin(tmp_path, world.kubelet_dir, fault_response=respond)
        plugin.start()
        try:
            yield Node(host, kube, world.kubelet, plugin, quarantine_file)
        finally:
            plugin.stop()


def condition(kube: RunningKubeAPI, pod: str) -> dict[str, Any] | None:
    (found,) = [p for p in kube.objects("pods") if p["metadata"]["name"] == pod]
    conditions = (found.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == XPU_HEALTHY_CONDITION), None)


def condition_becomes(kube: RunningKubeAPI, pod: str, status: str, reason: str) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        c = condition(kube, pod)
        return c if c is not None and (c["status"], c["reason"]) == (status, reason) else None

    return wait_for(check, timeout_seconds=BOUND_SECONDS, message=f"{pod}: {status} ({reason})")


def events(kube: RunningKubeAPI) -> list[tuple[str, str, str, str]]:
    """(type, reason, pod, message) of every Event, in creation order."""
    found = sorted(kube.objects("events"), key=lambda e: int(e["metadata"]["resourceVersion"]))
    return [(e["type"], e["reason"], e["involvedObject"]["name"], e["message"]) for e in found]


def list_and_watch(node: Node) -> dict[int, str]:
    """Card index -> health in the first answer of a fresh `ListAndWatch` (what kubelet would see)."""
    with node.kubelet.plugin_channel(SOCKET) as channel:
        stream = pb_grpc.DevicePluginStub(channel).ListAndWatch(pb.Empty(), timeout=10)
        first = next(stream)
        stream.cancel()
    return {int(d.ID[-2:], 16): d.health for d in first.devices}


def fail_and_recover(node: Node | Any) -> None:
    """Card 5 of ``node``'s host (anything with ``host`` and ``plugin``) fails its checks, then
    passes them again, each seen by the plugin's tracker."""
    set_table(node.host, "p800-failing")
    wait_for(
        lambda: node.plugin.monitor.tracker.state(5) is HealthState.UNHEALTHY,
        timeout_seconds=BOUND_SECONDS,
        message="card 5 failing",
    )
    set_table(node.host, "p800-8")
    wait_for(
        lambda: node.plugin.monitor.tracker.state(5) is HealthState.HEALTHY,
        timeout_seconds=BOUND_SECONDS,
        message="card 5 passing its checks",
    )


def test_failed_card_marks_its_pod_and_recovery_clears_it(node: Node) -> None:
    kube = node.kube
    assert list_and_watch(node) == dict.fromkeys(range(8), "Healthy")
    # every pod holding a card gets the condition at once (its readiness gate waits for it)
    condition_becomes(kube, "qwen-0", "True", "XpuHealthy")
    before = condition_becomes(kube, "qwen-1", "True", "XpuHealthy")
    assert before["message"] == f"node n1: healthy: xpu0 ({uuid(0)})"
    set_table(node.host, "p800-failing")  # card 5: 3 uncorrectable ECC errors (card 2 hot: warn only)

    failed = condition_becomes(kube, "qwen-0", "False", "XpuUnhealthy")
    assert failed["message"] == (f"node n1: xpu5 ({uuid(5)}): ecc-uncorrectable: 3 uncorrectable ECC errors")
    assert failed["lastTransitionTime"].endswith("Z")
    assert condition(kube, "qwen-1") == before  # holds card 0 only: untouched
    ecc = "ecc-uncorrectable: 3 uncorrectable ECC errors"
    warning = ("Warning", "XpuUnhealthy", "qwen-0", f"node n1: xpu5 ({uuid(5)}) Unhealthy: {ecc}")
    wait_for(lambda: events(kube) == [warning], timeout_seconds=BOUND_SECONDS, message="the Warning Event")
    (event,) = kube.objects("events")
    assert event["involvedObject"]["uid"] == kube.objects("pods")[0]["metadata"]["uid"]
    assert event["source"] == {"component": "kunlun-device-plugin", "host": "n1"}
    logger.info("pod condition: %s; event: %s", failed, warning)

    set_table(node.host, "p800-8")
    healthy = condition_becomes(kube, "qwen-0", "True", "XpuHealthy")
    assert healthy["message"] == f"node n1: healthy: xpu4 ({uuid(4)}), xpu5 ({uuid(5)})"
    wait_for(
        lambda: events(kube)[-1][:3] == ("Normal", "XpuHealthy", "qwen-0"),
        timeout_seconds=BOUND_SECONDS,
        message="the Normal Event",
    )
    assert list_and_watch(node) == dict.fromkeys(range(8), "Healthy")
    assert [c for c in kube.calls() if c[2] == "pods/status"] == [
        ("patch", "", "pods/status", "bank-prod")
    ] * 4  # qwen-0 and qwen-1 at start, then qwen-0 False and True: nothing rewritten unchanged


def test_failed_api_calls_are_retried_next_round(node: Node) -> None:
    kube = node.kube
    condition_becomes(kube, "qwen-0", "True", "XpuHealthy")
    fault = kube.fail("patch", "pods", status=500, times=2, subresource="status")
    set_table(node.host, "p800-failing")
    condition_becomes(kube, "qwen-0", "False", "XpuUnhealthy")
    assert fault.fired == 2
    assert [c for c in kube.calls() if c[2] == "pods/status"] == [
        ("patch", "", "pods/status", "bank-prod")
    ] * 5  # qwen-0 and qwen-1 at start, then qwen-0 failed twice and was written on the third round
    wait_for(lambda: len(events(kube)) == 1, timeout_seconds=BOUND_SECONDS, message="one Event")


def test_flapping_card_is_quarantined_until_readmitted(node: Node) -> None:
    kube = node.kube
    fail_and_recover(node)
    fail_and_recover(node)
    assert QUARANTINE_ANNOTATION not in (kube.objects("nodes")[0]["metadata"].get("annotations") or {})
    fail_and_recover(node)  # the third failure within the window

    wait_for(
        lambda: (
            kube.objects("nodes")[0]["metadata"].get("annotations", {}).get(QUARANTINE_ANNOTATION) == uuid(5)
        ),
        timeout_seconds=BOUND_SECONDS,
        message="the quarantine annotation",
    )
    quarantined = condition_becomes(kube, "qwen-0", "False", "XpuQuarantined")
    assert "quarantined after 3 failures within 600s" in quarantined["message"]
    assert node.plugin.monitor.tracker.state(5) is HealthState.HEALTHY  # its checks pass ...
    assert list_and_watch(node) == {
        i: "Unhealthy" if i == 5 else "Healthy" for i in range(8)
    }  # ... still out
    assert read_quarantine_file(node.quarantine_file) == {uuid(5)}
    wait_for(
        lambda: events(kube)[-1][:3] == ("Warning", "XpuQuarantined", "qwen-0"),
        timeout_seconds=BOUND_SECONDS,
        message="the quarantine Event",
    )

    # an operator re-admits the card: `kubectl annotate node n1 kunlun.dev/xpu-quarantine-`
    core = kubernetes.client.CoreV1Api(kube.client())
    core.patch_node("n1", {"metadata": {"annotations": {QUARANTINE_ANNOTATION: None}}})
    condition_becomes(kube, "qwen-0", "True", "XpuHealthy")
    assert list_and_watch(node) == dict.fromkeys(range(8), "Healthy")
    assert read_quarantine_file(node.quarantine_file) == frozenset()
    assert node.responder().quarantined == frozenset()

    fail_and_recover(node)  # counting starts afresh: one failure after re-admission is no quarantine
    condition_becomes(kube, "qwen-0", "True", "XpuHealthy")
    assert node.responder().quarantined == frozenset()


def test_node_with_every_card_unhealthy_is_tainted_until_one_recovers(node: Node) -> None:
    kube = node.kube
    nodes = node.host / "root" / "dev"
    for index in range(8):
        (nodes / f"xpu{index}").unlink()  # device-node-missing on every card

    def taints() -> list[dict[str, Any]]:
        return kube.objects("nodes")[0].get("spec", {}).get("taints") or []

    wait_for(
        lambda: taints() == [{"key": UNHEALTHY_TAINT, "value": "true", "effect": "NoSchedule"}],
        timeout_seconds=BOUND_SECONDS,
        message="the taint",
    )
    condition_becomes(kube, "qwen-1", "False", "XpuUnhealthy")
    (nodes / "xpu3").touch()
    wait_for(lambda: taints() == [], timeout_seconds=BOUND_SECONDS, message="the taint removed")

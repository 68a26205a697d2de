"""Issue 20 end to end: a failed card heals itself, device side and operator against ONE fake API.

The real operator (a subprocess) reconciles a KunlunInferenceService into a Deployment whose pods
carry the readiness gate; the real device plugin (``PluginServer`` with its ``FaultResponder``)
serves node xpu-1, reading a fake ``xpu-smi`` host, registering with the fake kubelet and asking
its PodResources (real gRPC) which pod holds which card; both talk to the same fake Kubernetes API
(real HTTP, ``tests/support/kubeapi.py``, which serves evictions and PodDisruptionBudgets).

The test plays what neither side does and the fake API has no controller for: the ReplicaSet and
scheduler (it creates the runtime pods, on cards ``ListAndWatch`` offers), kubelet (PodResources
assignments; the pod's ``Ready`` condition from its readiness gate; graceful termination, as a
finalizer it removes) and the disruption controller (the budget's ``status``). The service has one
replica (the default), so the budget allows no disruption once that replica is NotReady: the
operator's budget (``unhealthyPodEvictionPolicy: AlwaysAllow``) still lets its eviction through at
once, as the fake API decides by the API server's rule. Run with ``-s`` to see the timeline it
prints (also logged at INFO).
"""

from __future__ import annotations

import copy
import logging
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from time import monotonic
from typing import Any

import kubernetes
import pytest

from kunlun_device.api import deviceplugin_v1beta1_pb2 as pb
from kunlun_device.api import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from kunlun_device.faults import FaultResponder, QuarantinePolicy
from kunlun_device.labels import QUARANTINE_ANNOTATION, XPU_HEALTHY_CONDITION
from kunlun_device.plugin import PluginServer
from kunlun_device.podresources import PodResourcesClient
from kunlun_device.xpu.health_tracker import HealthState
from kunlun_device.xpu.model import XpuDevice
from tests.integration.device.fake_kubelet import FakeKubelet, FakePodResources, fast_plugin, short_tempdir
from tests.integration.device.test_fault_response import (
    BOUND_SECONDS,
    SOCKET,
    fail_and_recover,
    set_table,
    uuid,
)
from tests.integration.operator.conftest import NAMESPACE, Cluster, free_port, wait_for
from tests.support.kubeapi import running_fake_api
from tests.unit.device.hosts import copy_host

pytestmark = pytest.mark.slow
logger = logging.getLogger(__name__)

NODE = "xpu-1"
REPLACE_AFTER_SECONDS = 3
SPEC = {
    "model": {"name": "qwen", "source": {"hostPath": {"path": "/data/qwen"}}},
    "versions": {"driver": "5.0.21.26", "firmware": "1.0.2.14.1.54", "kml": "3.2.0"},
    "faultTolerance": {"replaceAfter": f"{REPLACE_AFTER_SECONDS}s"},
}
#: Plays kubelet's graceful termination: an evicted pod stays (terminating, still holding its card)
#: until the test removes this finalizer.
DRAINING = "tests.kunlun.dev/kubelet-draining"
FIRST, SECOND = "qwen-7d9f-abcde", "qwen-7d9f-fghij"
EVICTION = ("create", "", "pods/eviction", NAMESPACE)
ECC_DETAIL = "ecc-uncorrectable: 3 uncorrectable ECC errors"
ECC = f"node {NODE}: xpu5 ({uuid(5)}): {ECC_DETAIL}"


@dataclass
class Timeline:
    """What happened when, as the test saw it: offsets from the start of the test."""

    started: float = field(default_factory=monotonic)
    entries: list[tuple[float, str]] = field(default_factory=list)

    def mark(self, event: str) -> None:
        offset = monotonic() - self.started
        self.entries.append((offset, event))
        logger.info("t=%6.2fs %s", offset, event)

    def render(self) -> str:
        return "\n".join(f"t={offset:6.2f}s  {event}" for offset, event in self.entries)


@dataclass
class Bench:
    """One fake API; the operator on it; node xpu-1 with its device plugin and fake kubelet."""

    cluster: Cluster
    host: Path
    kubelet: FakeKubelet
    pod_resources: FakePodResources
    plugin: PluginServer
    timeline: Timeline

    @property
    def core(self) -> kubernetes.client.CoreV1Api:
        return self.cluster.core


@pytest.fixture
def bench(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Bench]:
    host = copy_host("p800-8", tmp_path)
    with running_fake_api(tmp_path) as kube, short_tempdir() as kubelet_dir:
        cluster = Cluster(kube, tmp_path)
        cluster.add_node(NODE)
        pod_resources = FakePodResources(kubelet_dir / "pod-resources.sock")
        pod_resources.start()
        kubelet = FakeKubelet(kubelet_dir)
        kubelet.start()

        def respond(devices: tuple[XpuDevice, ...]) -> FaultResponder:
            return FaultResponder(
                devices,
                NODE,
                kubernetes.client.CoreV1Api(kube.client()),
                PodResourcesClient(str(pod_resources.socket)),
                QuarantinePolicy(max_failures=3, window_seconds=600),
                node_sync_seconds=0.05,
                quarantine_file=tmp_path / "quarantine.json",
            )

        plugin = fast_plugin(tmp_path, kubelet_dir, fault_response=respond)
        plugin.start()
        timeline = Timeline()
        failed_before = request.session.testsfailed
        try:
            yield Bench(cluster, host, kubelet, pod_resources, plugin, timeline)
        finally:
            print(f"\n--- fault healing timeline ---\n{timeline.render()}")
            plugin.stop()
            for operator in cluster.operators:
                operator.stop()
            if request.session.testsfailed > failed_before:  # the call failed: show the operator's side
                for operator in cluster.operators:
                    print(f"--- {operator.log_path.name} ---\n{operator.log()}")
            kubelet.stop()
            pod_resources.stop()


# --- what the test reads --------------------------------------------------------------------------


def pod(bench: Bench, name: str) -> dict[str, Any] | None:
    found = [p for p in bench.cluster.kube.objects("pods") if p["metadata"]["name"] == name]
    return found[0] if found else None


def xpu_condition(bench: Bench, name: str) -> tuple[str, str, str] | None:
    """(status, reason, message) of the pod's ``kunlun.dev/xpu-healthy`` condition."""
    conditions = ((pod(bench, name) or {}).get("status") or {}).get("conditions") or []
    found = [c for c in conditions if c["type"] == XPU_HEALTHY_CONDITION]
    return (found[0]["status"], found[0]["reason"], found[0]["message"]) if found else None


def condition_becomes(bench: Bench, name: str, status: str, reason: str) -> str:
    """Wait (the device side's bound) for the pod's condition; return its message."""
    found = wait_for(
        lambda: (c := xpu_condition(bench, name)) and c[:2] == (status, reason) and c,
        timeout_seconds=BOUND_SECONDS,
        message=f"{name}: {XPU_HEALTHY_CONDITION}={status} ({reason})",
    )
    return found[2]


def events_on(bench: Bench, kind: str) -> list[tuple[str, str, str, str]]:
    """(type, reason, object name, message) of the Events on objects of ``kind``, oldest first."""
    found = sorted(bench.cluster.kube.objects("events"), key=lambda e: int(e["metadata"]["resourceVersion"]))
    return [
        (e["type"], e["reason"], e["involvedObject"]["name"], e["message"])
        for e in found
        if e["involvedObject"].get("kind") == kind
    ]


def replicas_healthy(bench: Bench) -> tuple[str, str, str] | None:
    return bench.cluster.condition("ReplicasHealthy")


def operator_says(bench: Bench, reason: str) -> tuple[str, str, str]:
    return wait_for(
        lambda: (c := replicas_healthy(bench)) and c[1] == reason and c, message=f"ReplicasHealthy {reason}"
    )


def list_and_watch(bench: Bench) -> dict[int, str]:
    """Card index -> health in the first answer of a fresh ``ListAndWatch`` (what kubelet sees)."""
    with bench.kubelet.plugin_channel(SOCKET) as channel:
        stream = pb_grpc.DevicePluginStub(channel).ListAndWatch(pb.Empty(), timeout=10)
        first = next(stream)
        stream.cancel()
    return {int(d.ID[-2:], 16): d.health for d in first.devices}


def annotation(bench: Bench) -> str | None:
    node = bench.core.read_node(NODE)
    return (node.metadata.annotations or {}).get(QUARANTINE_ANNOTATION)


# --- what the test does in the place of controllers -----------------------------------------------


def set_budget(bench: Bench, current_healthy: int) -> None:
    """Play the disruption controller for one replica and maxUnavailable 1 (desiredHealthy 0)."""
    kubernetes.client.PolicyV1Api(bench.cluster.kube.client()).patch_namespaced_pod_disruption_budget_status(
        "qwen",
        NAMESPACE,
        {
            "status": {
                "observedGeneration": 1,
                "currentHealthy": current_healthy,
                "desiredHealthy": 0,
                "expectedPods": 1,
                "disruptionsAllowed": current_healthy,
            }
        },
    )


def kubelet_sets_ready(bench: Bench, name: str) -> bool:
    """Play kubelet: the pod's ``Ready`` follows its readiness gate (our condition); returns it."""
    conditions = (pod(bench, name) or {}).get("status", {}).get("conditions") or []
    ours = [c for c in conditions if c["type"] == XPU_HEALTHY_CONDITION]
    ready = bool(ours) and ours[0]["status"] == "True"
    ready_condition = {
        "type": "Ready",
        "status": str(ready),
        "reason": "" if ready else "ReadinessGatesNotReady",
    }
    others = [c for c in conditions if c["type"] != "Ready"]
    bench.core.patch_namespaced_pod_status(
        name, NAMESPACE, {"status": {"conditions": [*others, ready_condition]}}
    )
    return ready


def schedule_pod(bench: Bench, template: dict[str, Any], name: str, card: int) -> None:
    """Play the ReplicaSet, the scheduler and kubelet: a pod of ``template`` on xpu-1 holding ``card``."""
    assert list_and_watch(bench)[card] == "Healthy", f"card {card} is not allocatable"
    meta = {"name": name, "labels": template["metadata"]["labels"], "finalizers": [DRAINING]}
    body = {"metadata": meta, "spec": {**copy.deepcopy(template["spec"]), "nodeName": NODE}}
    bench.core.create_namespaced_pod(NAMESPACE, body)
    bench.pod_resources.assignments[(NAMESPACE, name, "runtime")] = [uuid(card)]


def finish_termination(bench: Bench, name: str) -> None:
    """Play kubelet: the evicted pod has drained; its card is free and the pod object goes."""
    del bench.pod_resources.assignments[(NAMESPACE, name, "runtime")]
    bench.core.patch_namespaced_pod(name, NAMESPACE, {"metadata": {"finalizers": None}})


# --- the scenario, step by step ----------------------------------------------------------------


def start_serving(bench: Bench, metrics_port: int) -> dict[str, Any]:
    """The operator builds the Deployment (gated on our condition); its first pod holds xpu5."""
    cluster, timeline = bench.cluster, bench.timeline
    cluster.start_operator("--metrics-port", str(metrics_port))
    cluster.create_service(copy.deepcopy(SPEC))
    template = wait_for(cluster.deployment, message="the Deployment")["spec"]["template"]
    assert template["spec"]["readinessGates"] == [{"conditionType": XPU_HEALTHY_CONDITION}]
    wait_for(lambda: cluster.kube.objects("poddisruptionbudgets", "policy"), message="the budget")
    budget = cluster.kube.objects("poddisruptionbudgets", "policy")[0]
    assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    timeline.mark("operator: Deployment qwen (readiness gate kunlun.dev/xpu-healthy), PDB qwen (AlwaysAllow)")
    schedule_pod(bench, template, FIRST, card=5)
    assert condition_becomes(bench, FIRST, "True", "XpuHealthy") == f"node {NODE}: healthy: xpu5 ({uuid(5)})"
    assert kubelet_sets_ready(bench, FIRST)
    set_budget(bench, current_healthy=1)
    operator_says(bench, "AllCardsHealthy")
    timeline.mark(f"pod {FIRST} holds xpu5: condition True (XpuHealthy), Ready; ReplicasHealthy True")
    return template


def fail_card_5(bench: Bench) -> None:
    """Uncorrectable ECC on xpu5: withdrawn from kubelet, its pod marked, the operator waits."""
    timeline = bench.timeline
    set_table(bench.host, "p800-failing")  # card 5: 3 uncorrectable ECC errors
    timeline.mark("xpu5 reports 3 uncorrectable ECC errors")
    assert condition_becomes(bench, FIRST, "False", "XpuUnhealthy") == ECC
    assert not kubelet_sets_ready(bench, FIRST)
    set_budget(bench, current_healthy=0)  # the only replica is NotReady: no disruption allowed
    timeline.mark(f"pod {FIRST}: condition False (XpuUnhealthy), NotReady; budget allows 0 disruptions")
    warning = ("Warning", "XpuUnhealthy", FIRST, f"node {NODE}: xpu5 ({uuid(5)}) Unhealthy: {ECC_DETAIL}")
    wait_for(
        lambda: events_on(bench, "Pod") == [warning], timeout_seconds=BOUND_SECONDS, message="Warning Event"
    )
    timeline.mark(f"Warning Event XpuUnhealthy on pod {FIRST}")
    assert list_and_watch(bench) == {i: "Unhealthy" if i == 5 else "Healthy" for i in range(8)}
    timeline.mark("ListAndWatch: xpu5 Unhealthy (not allocatable)")
    waiting = operator_says(bench, "CardUnhealthy")
    assert f"pod {FIRST} on node {NODE}" in waiting[2]
    assert EVICTION not in bench.cluster.kube.calls()  # not before replaceAfter
    timeline.mark("operator: ReplicasHealthy False (CardUnhealthy)")


def evict_the_not_ready_replica(bench: Bench) -> dict[str, Any]:
    """After replaceAfter: the only replica, NotReady, is evicted at once though the budget is 0.

    Under the default ``IfHealthyBudget`` the API server would refuse it (429) forever: nothing
    healthy is left to protect, yet ``disruptionsAllowed`` is 0. Returns ``status.lastReplacement``.
    """
    cluster, timeline = bench.cluster, bench.timeline
    wait_for(lambda: cluster.status().get("replicaReplacements") == 1, message="one replacement")
    assert cluster.kube.calls().count(EVICTION) == 1  # the first request was accepted
    timeline.mark("eviction 201 at once (NotReady, AlwaysAllow): status replicaReplacements 1")
    assert pod(bench, FIRST)["metadata"]["deletionTimestamp"]  # terminating, still holding xpu5
    assert cluster.kube.objects("poddisruptionbudgets", "policy")[0]["status"]["disruptionsAllowed"] == 0
    last = cluster.status()["lastReplacement"]
    assert (last["pod"], last["node"], last["reason"]) == (FIRST, NODE, "XpuUnhealthy")
    timeline.mark(f"status: lastReplacement {last}")
    cluster.wait_for_events("ReplacingReplica")
    [(_, _, owner, message)] = [
        e for e in events_on(bench, "KunlunInferenceService") if e[1] == "ReplacingReplica"
    ]
    assert owner == "qwen" and f"node {NODE}" in message and f"xpu5 ({uuid(5)})" in message
    assert "WaitingForDisruptionBudget" not in cluster.event_reasons()
    timeline.mark(f"Event ReplacingReplica on qwen: {message}")
    return last


def replace_and_recover(bench: Bench, template: dict[str, Any]) -> None:
    """The replacement lands on another card; xpu5 recovers under the pod still draining on it."""
    timeline = bench.timeline
    allocatable = [i for i, health in list_and_watch(bench).items() if health == "Healthy"]
    assert 5 not in allocatable
    schedule_pod(bench, template, SECOND, card=allocatable[0])
    condition_becomes(bench, SECOND, "True", "XpuHealthy")
    timeline.mark(f"replacement {SECOND} on xpu{allocatable[0]} (xpu5 withdrawn): condition True")

    set_table(bench.host, "p800-8")
    timeline.mark("xpu5 errors cleared")
    condition_becomes(bench, FIRST, "True", "XpuHealthy")  # still draining, still holding xpu5
    wait_for(
        lambda: events_on(bench, "Pod")[-1][:3] == ("Normal", "XpuHealthy", FIRST),
        timeout_seconds=BOUND_SECONDS,
        message="the Normal Event",
    )
    assert list_and_watch(bench) == dict.fromkeys(range(8), "Healthy")
    timeline.mark(f"recovery: {FIRST} (draining, holds xpu5) condition True; xpu5 allocatable again")
    operator_says(bench, "AllCardsHealthy")
    timeline.mark("operator: ReplicasHealthy True")


def quarantine_and_readmit(bench: Bench) -> None:
    """Two more failures (three in the window): quarantined, out until the annotation goes."""
    timeline = bench.timeline
    fail_and_recover(bench)  # the second failure within the window
    assert annotation(bench) is None
    fail_and_recover(bench)  # the third: quarantined
    wait_for(lambda: annotation(bench) == uuid(5), timeout_seconds=BOUND_SECONDS, message="the quarantine")
    quarantined = condition_becomes(bench, FIRST, "False", "XpuQuarantined")
    assert "quarantined after 3 failures within 600s" in quarantined
    assert bench.plugin.monitor.tracker.state(5) is HealthState.HEALTHY  # its checks pass ...
    assert list_and_watch(bench)[5] == "Unhealthy"  # ... it stays out
    timeline.mark(
        "quarantine: 3rd failure in 600s, node annotation set, xpu5 Unhealthy though its checks pass"
    )

    bench.core.patch_node(NODE, {"metadata": {"annotations": {QUARANTINE_ANNOTATION: None}}})
    timeline.mark("re-admitted: annotation removed")
    condition_becomes(bench, FIRST, "True", "XpuHealthy")
    # The plugin publishes the states to kubelet before it writes any pod (act()), so this holds
    # already; polled with the device side's bound only so that the check cannot race the stream.
    wait_for(
        lambda: list_and_watch(bench) == dict.fromkeys(range(8), "Healthy"),
        timeout_seconds=BOUND_SECONDS,
        message="xpu5 allocatable after re-admission",
    )
    timeline.mark(f"{FIRST} condition True; xpu5 allocatable")


def test_a_failed_card_is_withdrawn_its_replica_replaced_and_a_flapping_card_quarantined(
    bench: Bench,
) -> None:
    cluster = bench.cluster
    metrics_port = free_port()
    template = start_serving(bench, metrics_port)
    fail_card_5(bench)
    last = evict_the_not_ready_replica(bench)
    replace_and_recover(bench, template)
    quarantine_and_readmit(bench)

    finish_termination(bench, FIRST)
    wait_for(lambda: pod(bench, FIRST) is None, message=f"{FIRST} gone")
    operator_says(bench, "AllCardsHealthy")
    assert cluster.kube.calls().count(EVICTION) == 1  # a terminating pod is never evicted again
    assert cluster.status()["replicaReplacements"] == 1
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
        metrics = response.read().decode()
    assert 'kunlun_operator_replica_replacements_total{reason="XpuUnhealthy"} 1.0' in metrics
    bench.timeline.mark(f"{FIRST} drained and gone: ReplicasHealthy True, replicaReplacements 1")

    assert last["card"] == "5"  # read back from the node agent's own message

"""A replica on a failed card is replaced through the Eviction API, respecting the disruption budget.

The node agent's and kubelet's parts are played by the test: it writes the pod's card health
(``allocatedResourcesStatus`` or our ``kunlun.dev/xpu-healthy`` condition) and its ``Ready``
condition; the disruption controller's part too: it writes the budget's ``status``. The fake API
decides evictions by the API server's rule (``tests/support/kubeapi.py``): a Ready pod needs
``disruptionsAllowed > 0``; a NotReady one goes at once under the operator's ``AlwaysAllow``.
"""

from __future__ import annotations

import copy
import datetime
import urllib.request
from typing import Any

import kubernetes
import pytest

from kunlun_operator import names
from tests.integration.operator.conftest import (
    NAMESPACE,
    RUNTIME_POD_LABELS,
    Cluster,
    add_failed_pod,
    free_port,
    wait_for,
)

pytestmark = pytest.mark.slow
SPEC = {
    "model": {"name": "qwen", "source": {"hostPath": {"path": "/data/qwen"}}},
    "versions": {"driver": "5.0.21.26", "firmware": "1.0.2.14.1.54", "kml": "3.2.0"},
    "faultTolerance": {"replaceAfter": "5s"},
}
EVICTION = ("create", "", "pods/eviction", NAMESPACE)
POD = "qwen-7d9f-abcde"


def replicas_healthy(cluster: Cluster) -> tuple[str, str, str] | None:
    return cluster.condition("ReplicasHealthy")


def start(cluster: Cluster, metrics_port: int | None = None) -> None:
    cluster.add_node("xpu-1")
    cluster.start_operator(*(("--metrics-port", str(metrics_port)) if metrics_port else ()))
    cluster.create_service(copy.deepcopy(SPEC))
    wait_for(lambda: (replicas_healthy(cluster) or ("",))[0] == "True", message="ReplicasHealthy True")
    deployment = wait_for(cluster.deployment, message="the deployment")
    gates = deployment["spec"]["template"]["spec"]["readinessGates"]
    assert gates == [{"conditionType": "kunlun.dev/xpu-healthy"}]
    budget = wait_for(lambda: cluster.kube.objects("poddisruptionbudgets", "policy"), message="the budget")
    assert budget[0]["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def set_budget(cluster: Cluster, **status: int) -> None:
    """Play the disruption controller: write the service's PodDisruptionBudget status."""
    kubernetes.client.PolicyV1Api(cluster.kube.client()).patch_namespaced_pod_disruption_budget_status(
        "qwen", NAMESPACE, {"status": {"observedGeneration": 1, **status}}
    )


CLASSIC_CARD_5 = {"name": names.RESOURCE_NAME, "resources": [{"resourceID": "5", "health": "Unhealthy"}]}
#: The same card claimed through DRA, as the kubelet writes it (the CDI id our DRA plugin returned).
CLAIMED_CARD_5 = {
    "name": "claim:xpus",
    "resources": [
        {"resourceID": "kunlun.dev/xpu=0b1c2d3e-xpu-4", "health": "Healthy"},
        {"resourceID": "kunlun.dev/xpu=0b1c2d3e-xpu-5", "health": "Unhealthy"},
    ],
}


def add_ready_pod_on_failed_card(cluster: Cluster, allocated: dict[str, Any] = CLASSIC_CARD_5) -> None:
    """A Ready runtime pod whose card 5 only the kubelet reports Unhealthy (allocatedResourcesStatus)."""
    pod = {
        "metadata": {"name": POD, "labels": RUNTIME_POD_LABELS},
        "spec": {"nodeName": "xpu-1", "containers": []},
    }
    cluster.core.create_namespaced_pod(NAMESPACE, pod)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    status: dict[str, Any] = {
        "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}],
        "containerStatuses": [
            {
                "name": "runtime",
                "image": "kunlun-runtime:test",
                "imageID": "",
                "ready": True,
                "restartCount": 0,
                "allocatedResourcesStatus": [allocated],
            }
        ],
    }
    cluster.core.patch_namespaced_pod_status(POD, NAMESPACE, {"status": status})


def test_a_ready_replica_on_a_failed_card_is_evicted_after_replace_after_once_the_budget_allows(
    cluster: Cluster,
) -> None:
    metrics_port = free_port()
    start(cluster, metrics_port)
    set_budget(cluster, expectedPods=2, currentHealthy=1, desiredHealthy=1, disruptionsAllowed=0)
    add_ready_pod_on_failed_card(cluster)  # Ready: it counts as healthy, so the budget decides
    waiting = wait_for(
        lambda: (c := replicas_healthy(cluster)) and c[1] == "CardUnhealthy" and c, message="CardUnhealthy"
    )
    assert f"pod {POD} on node xpu-1 (card 5)" in waiting[2]
    assert EVICTION not in cluster.kube.calls()  # not before replaceAfter

    blocked = wait_for(
        lambda: (c := replicas_healthy(cluster)) and c[1] == "WaitingForDisruptionBudget" and c,
        message="waiting for the disruption budget",
    )
    assert blocked[0] == "False"
    assert "PodDisruptionBudget allows no disruption" in blocked[2]
    assert cluster.status()["replicaReplacements"] == 0
    assert [p["metadata"]["name"] for p in cluster.kube.objects("pods")] == [POD]
    cluster.wait_for_events("WaitingForDisruptionBudget")

    set_budget(cluster, expectedPods=2, currentHealthy=2, desiredHealthy=1, disruptionsAllowed=1)
    wait_for(lambda: cluster.status().get("replicaReplacements") == 1, message="one replacement")
    assert cluster.kube.objects("pods") == []
    assert cluster.kube.objects("poddisruptionbudgets", "policy")[0]["status"]["disruptionsAllowed"] == 0
    assert cluster.status()["lastReplacement"] | {"time": "t"} == {
        "pod": POD,
        "node": "xpu-1",
        "card": "5",
        "reason": "DeviceUnhealthy",
        "time": "t",
    }
    cluster.wait_for_events("ReplacingReplica")
    [event] = [e for e in cluster.kube.objects("events") if e.get("reason") == "ReplacingReplica"]
    assert "node xpu-1" in event["message"] and "card 5" in event["message"]
    assert event["involvedObject"]["name"] == "qwen"
    wait_for(lambda: (replicas_healthy(cluster) or ("",))[0] == "True", message="healthy again")
    assert cluster.kube.calls().count(EVICTION) >= 2  # 429 at least once, then 201

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
        metrics = response.read().decode()
    assert 'kunlun_operator_replica_replacements_total{reason="DeviceUnhealthy"} 1.0' in metrics


def test_the_only_replica_held_not_ready_by_the_gate_is_evicted_at_once_though_the_budget_is_zero(
    cluster: Cluster,
) -> None:
    start(cluster)
    # What the disruption controller computes for replicas 1, maxUnavailable 1 and that pod NotReady:
    # under the default IfHealthyBudget every eviction would be refused (429) forever.
    set_budget(cluster, expectedPods=1, currentHealthy=0, desiredHealthy=0, disruptionsAllowed=0)
    add_failed_pod(cluster, POD)  # condition False: the readiness gate holds it NotReady
    wait_for(lambda: cluster.status().get("replicaReplacements") == 1, message="one replacement")
    assert cluster.kube.calls().count(EVICTION) == 1  # the first request was accepted
    assert cluster.kube.objects("pods") == []
    assert cluster.kube.objects("poddisruptionbudgets", "policy")[0]["status"]["disruptionsAllowed"] == 0
    assert "WaitingForDisruptionBudget" not in cluster.event_reasons()


def test_a_replica_whose_claimed_card_the_kubelet_reports_unhealthy_is_replaced_too(cluster: Cluster) -> None:
    start(cluster)
    set_budget(cluster, expectedPods=2, currentHealthy=2, desiredHealthy=1, disruptionsAllowed=1)
    add_ready_pod_on_failed_card(cluster, CLAIMED_CARD_5)
    wait_for(lambda: cluster.status().get("replicaReplacements") == 1, message="one replacement")
    assert cluster.kube.objects("pods") == []
    assert cluster.status()["lastReplacement"] | {"time": "t"} == {
        "pod": POD,
        "node": "xpu-1",
        "card": "xpu-5",
        "reason": "DeviceUnhealthy",
        "time": "t",
    }

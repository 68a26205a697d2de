"""A replica on a failed card is replaced through the Eviction API, respecting the disruption budget.

The node agent's part is played by the test: it marks the pod's ``kunlun.dev/xpu-healthy``
condition False (naming node and card). The fake API has no PodDisruptionBudget logic: the test
answers the first evictions with 429 (no budget left), then lets them through (the pod is deleted).
"""

from __future__ import annotations

import copy
import urllib.request

import pytest

from tests.integration.operator.conftest import NAMESPACE, Cluster, add_failed_pod, free_port, wait_for

pytestmark = pytest.mark.slow
SPEC = {
    "model": {"name": "qwen", "source": {"hostPath": {"path": "/data/qwen"}}},
    "versions": {"driver": "5.0.21.26", "firmware": "1.0.2.14.1.54", "kml": "3.2.0"},
    "faultTolerance": {"replaceAfter": "5s"},
}
EVICTION = ("create", "", "pods/eviction", NAMESPACE)


def replicas_healthy(cluster: Cluster) -> tuple[str, str, str] | None:
    return cluster.condition("ReplicasHealthy")


def test_a_replica_on_a_failed_card_is_evicted_after_replace_after_once_the_budget_allows(
    cluster: Cluster,
) -> None:
    cluster.add_node("xpu-1")
    metrics_port = free_port()
    cluster.start_operator("--metrics-port", str(metrics_port))
    cluster.create_service(copy.deepcopy(SPEC))
    wait_for(lambda: (replicas_healthy(cluster) or ("",))[0] == "True", message="ReplicasHealthy True")
    deployment = wait_for(cluster.deployment, message="the deployment")
    gates = deployment["spec"]["template"]["spec"]["readinessGates"]
    assert gates == [{"conditionType": "kunlun.dev/xpu-healthy"}]

    cluster.kube.fail("create", "pods", status=429, times=None, subresource="eviction")  # PDB: no budget
    add_failed_pod(cluster)
    waiting = wait_for(
        lambda: (c := replicas_healthy(cluster)) and c[1] == "CardUnhealthy" and c, message="CardUnhealthy"
    )
    assert "pod qwen-7d9f-abcde on node xpu-1 (card 5)" in waiting[2]
    assert EVICTION not in cluster.kube.calls()  # not before replaceAfter

    blocked = wait_for(
        lambda: (c := replicas_healthy(cluster)) and c[1] == "WaitingForDisruptionBudget" and c,
        message="waiting for the disruption budget",
    )
    assert blocked[0] == "False"
    assert "PodDisruptionBudget allows no disruption" in blocked[2]
    assert cluster.status()["replicaReplacements"] == 0
    assert [p["metadata"]["name"] for p in cluster.kube.objects("pods")] == ["qwen-7d9f-abcde"]
    cluster.wait_for_events("WaitingForDisruptionBudget")

    cluster.kube.clear_faults()  # budget is back: the next retry is accepted (201)
    wait_for(lambda: cluster.status().get("replicaReplacements") == 1, message="one replacement")
    assert cluster.kube.objects("pods") == []
    assert cluster.status()["lastReplacement"] | {"time": "t"} == {
        "pod": "qwen-7d9f-abcde",
        "node": "xpu-1",
        "card": "5",
        "reason": "XpuUnhealthy",
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
    assert 'kunlun_operator_replica_replacements_total{reason="XpuUnhealthy"} 1.0' in metrics

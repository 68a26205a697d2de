"""A readiness gate nobody reports on never stalls a rollout silently (the real operator, fake API).

The test plays kubelet (it writes the pod's phase and ``ContainersReady`` with the time the
containers became ready) and the device plugin's node agent (it writes ``kunlun.dev/xpu-healthy``,
or fails to). Time is virtual where the operator would wait: a pod whose containers have been ready
for ten minutes says so in its ``lastTransitionTime``, so "the grace period passed" needs no wait.
"""

from __future__ import annotations

import copy
import datetime
import urllib.request
from typing import Any

import kubernetes
import pytest

from kunlun_operator import names
from tests.integration.operator.conftest import NAMESPACE, RUNTIME_POD_LABELS, Cluster, free_port, wait_for

pytestmark = pytest.mark.slow
SPEC = {
    "model": {"name": "qwen", "source": {"hostPath": {"path": "/data/qwen"}}},
    "versions": {"driver": "5.0.21.26", "firmware": "1.0.2.14.1.54", "kml": "3.2.0"},
}
GATE = "kunlun.dev/xpu-healthy"
STATUS_PATCH = ("patch", "", "pods/status", NAMESPACE)
PLUGIN_TRUE = {"type": GATE, "status": "True", "reason": "XpuHealthy", "message": "node xpu-1: healthy: xpu0"}
PLUGIN_FALSE = {
    "type": GATE,
    "status": "False",
    "reason": "XpuUnhealthy",
    "message": "node xpu-1: xpu0 (KL-0): ecc",
}
RUNTIME_STATUS = {
    "name": "runtime",
    "image": "kunlun-runtime:test",
    "imageID": "",
    "ready": True,
    "restartCount": 0,
}


def ago(seconds: float) -> str:
    moment = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=seconds)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def start(cluster: Cluster, *flags: str) -> None:
    cluster.add_node("xpu-1")
    cluster.start_operator(*flags)
    cluster.create_service(copy.deepcopy(SPEC))
    wait_for(lambda: cluster.condition("CardHealthReported"), message="the first status")
    assert cluster.condition("CardHealthReported")[:2] == ("True", "HealthReported")


def add_pod(cluster: Cluster, name: str) -> None:
    """A runtime pod with the readiness gate, as the Deployment's template makes it (not yet running)."""
    pod = {
        "metadata": {"name": name, "labels": RUNTIME_POD_LABELS},
        "spec": {
            "nodeName": "xpu-1",
            "containers": [{"name": "runtime", "image": "kunlun-runtime:test"}],
            "readinessGates": [{"conditionType": GATE}],
        },
    }
    cluster.core.create_namespaced_pod(NAMESPACE, pod)


def conditions(cluster: Cluster, name: str) -> list[dict[str, Any]]:
    pod = cluster.core.api_client.sanitize_for_serialization(
        cluster.core.read_namespaced_pod_status(name, NAMESPACE)
    )
    return (pod.get("status") or {}).get("conditions") or []


def gate(cluster: Cluster, name: str) -> tuple[str, str] | None:
    found = [(c["status"], c["reason"]) for c in conditions(cluster, name) if c["type"] == GATE]
    return found[0] if found else None


def kubelet_ready(cluster: Cluster, name: str, *, since: str, extra: list[dict[str, Any]] = ()) -> None:
    """Play kubelet: the pod runs and its containers are ready since ``since``; only the gate is left."""
    status = {
        "phase": "Running",
        "conditions": [
            {"type": "ContainersReady", "status": "True", "lastTransitionTime": since},
            {
                "type": "Ready",
                "status": "False",
                "reason": "ReadinessGatesNotReady",
                "lastTransitionTime": since,
            },
            *extra,
        ],
    }
    cluster.core.patch_namespaced_pod_status(name, NAMESPACE, {"status": status})


def plugin_writes(cluster: Cluster, name: str, verdict: dict[str, Any]) -> None:
    """Play the node agent: add its verdict to the pod's conditions (a merge patch replaces the list)."""
    kept = [c for c in conditions(cluster, name) if c["type"] != GATE]
    cluster.core.patch_namespaced_pod_status(
        name, NAMESPACE, {"status": {"conditions": [*kept, {**verdict, "lastTransitionTime": ago(0)}]}}
    )


def events_on(cluster: Cluster, kind: str, reason: str) -> list[dict[str, Any]]:
    return [
        e
        for e in cluster.kube.objects("events")
        if e.get("reason") == reason and e["involvedObject"]["kind"] == kind
    ]


def test_plugin_down_at_pod_start_the_gate_opens_after_the_grace_period_announced_and_the_plugin_wins_later(
    cluster: Cluster,
) -> None:
    metrics_port = free_port()
    start(cluster, "--metrics-port", str(metrics_port))  # default grace: 120 s
    add_pod(cluster, "qwen-a")
    kubelet_ready(cluster, "qwen-a", since=ago(600))  # ready for 10 minutes, no device plugin
    assert wait_for(lambda: gate(cluster, "qwen-a"), message="the operator's condition") == (
        "True",
        "NoHealthReporter",
    )
    status, reason, message = wait_for(
        lambda: (c := cluster.condition("CardHealthReported")) and c[0] == "False" and c,
        message="not reported",
    )
    assert (status, reason) == ("False", "NoHealthReporter")
    assert "pod qwen-a on node xpu-1" in message and "not monitored" in message
    wait_for(lambda: events_on(cluster, "Pod", "NoHealthReporter"), message="the event on the pod")
    wait_for(
        lambda: events_on(cluster, "KunlunInferenceService", "NoHealthReporter"),
        message="the service's event",
    )
    [pod_event] = events_on(cluster, "Pod", "NoHealthReporter")
    assert (pod_event["type"], pod_event["involvedObject"]["name"]) == ("Warning", "qwen-a")
    assert "within 120s" in pod_event["message"]
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
        metrics = response.read().decode()
    assert "kunlun_operator_health_gates_opened_total 1.0" in metrics
    assert "kunlun_operator_unmonitored_pods 1.0" in metrics

    plugin_writes(cluster, "qwen-a", PLUGIN_TRUE)  # the device plugin is back: its verdict replaces ours
    wait_for(
        lambda: (cluster.condition("CardHealthReported") or ("",))[0] == "True", message="reported again"
    )
    assert gate(cluster, "qwen-a") == ("True", "XpuHealthy")


def test_a_gate_is_opened_when_its_grace_period_ends_without_another_event(cluster: Cluster) -> None:
    start(cluster, "--xpu-health-gate-grace-seconds", "2")
    add_pod(cluster, "qwen-a")
    kubelet_ready(cluster, "qwen-a", since=ago(0))
    wait_for(
        lambda: (cluster.condition("CardHealthReported") or ("", ""))[1] == "AwaitingHealthReport",
        message="waiting",
    )
    assert wait_for(lambda: gate(cluster, "qwen-a"), message="the loop waking itself") == (
        "True",
        "NoHealthReporter",
    )


def test_plugin_restart_mid_rollout_its_late_verdicts_win_and_the_operator_does_not_interfere(
    cluster: Cluster,
) -> None:
    start(cluster)  # default grace: 120 s
    own_writes = 0
    for name in ("qwen-old", "qwen-sick", "qwen-new"):
        add_pod(cluster, name)
    kubelet_ready(
        cluster, "qwen-old", since=ago(3600), extra=[{**PLUGIN_TRUE, "lastTransitionTime": ago(3600)}]
    )
    kubelet_ready(
        cluster, "qwen-sick", since=ago(3600), extra=[{**PLUGIN_FALSE, "lastTransitionTime": ago(5)}]
    )
    kubelet_ready(cluster, "qwen-new", since=ago(5))  # the rollout's new pod, while the plugin restarts
    own_writes += 3
    _, _, message = wait_for(
        lambda: (c := cluster.condition("CardHealthReported")) and c[1] == "AwaitingHealthReport" and c,
        message="the operator waiting for the report on the new pod",
    )
    assert message.startswith(
        "waiting for a device plugin to report the card health of pod qwen-new on node xpu-1"
    )
    wait_for(
        lambda: (cluster.condition("ReplicasHealthy") or ("", ""))[1] == "CardUnhealthy",
        message="the sick pod seen",
    )

    plugin_writes(cluster, "qwen-new", PLUGIN_TRUE)  # the restarted plugin reports, well within the grace
    own_writes += 1
    wait_for(lambda: (cluster.condition("CardHealthReported") or ("",))[0] == "True", message="reported")
    assert [gate(cluster, n) for n in ("qwen-old", "qwen-sick", "qwen-new")] == [
        ("True", "XpuHealthy"),
        ("False", "XpuUnhealthy"),  # a plugin's False is never overridden, however long it lasts
        ("True", "XpuHealthy"),
    ]
    assert cluster.kube.calls().count(STATUS_PATCH) == own_writes  # the operator wrote no pod
    assert "NoHealthReporter" not in cluster.event_reasons()


def test_a_denied_plugin_patch_is_handled_like_no_plugin_and_a_denied_operator_patch_is_reported(
    cluster: Cluster,
) -> None:
    start(cluster)
    add_pod(cluster, "qwen-a")
    cluster.kube.fail("patch", "pods", status=403, subresource="status")
    with pytest.raises(kubernetes.client.ApiException) as denied:
        plugin_writes(cluster, "qwen-a", PLUGIN_TRUE)  # the node agent's pods/status right is missing
    assert denied.value.status == 403
    kubelet_ready(cluster, "qwen-a", since=ago(600))
    cluster.kube.fail("patch", "pods", status=403, subresource="status", times=None)  # and the operator's
    _, reason, message = wait_for(
        lambda: (c := cluster.condition("CardHealthReported")) and "could not set" in c[2] and c,
        message="the operator's denied write reported",
    )
    assert reason == "NoHealthReporter" and "(403 InjectedFault; it needs patch on pods/status)" in message
    assert gate(cluster, "qwen-a") is None  # never False: the gate just stays closed
    [denied_event] = wait_for(
        lambda: events_on(cluster, "KunlunInferenceService", "CannotSetHealthGate"), message="the event"
    )
    assert denied_event["type"] == "Warning" and "pod qwen-a on node xpu-1" in denied_event["message"]
    cluster.kube.clear_faults()  # the operator's right is granted: its retry goes through
    assert wait_for(lambda: gate(cluster, "qwen-a"), message="the retried write") == (
        "True",
        "NoHealthReporter",
    )


def test_a_pod_whose_card_the_kubelet_reports_unhealthy_is_never_opened_however_late(
    cluster: Cluster,
) -> None:
    start(cluster)  # default grace: 120 s
    add_pod(cluster, "qwen-a")
    # the plugin runs (kubelet has its ListAndWatch verdict) but its pods/status patch was denied
    card = {"name": names.RESOURCE_NAME, "resources": [{"resourceID": "xpu0", "health": "Unhealthy"}]}
    cluster.core.patch_namespaced_pod_status(
        "qwen-a",
        NAMESPACE,
        {"status": {"containerStatuses": [{**RUNTIME_STATUS, "allocatedResourcesStatus": [card]}]}},
    )
    kubelet_ready(cluster, "qwen-a", since=ago(600))  # ready for 10 minutes: well past the grace
    _, reason, message = wait_for(
        lambda: (c := cluster.condition("CardHealthReported")) and "kubelet reports" in c[2] and c,
        message="the held pod reported",
    )
    assert reason == "NoHealthReporter"
    assert (
        "pod qwen-a on node xpu-1 has no card health report but the kubelet reports its card xpu0" in message
    )
    wait_for(
        lambda: (cluster.condition("ReplicasHealthy") or ("", ""))[1] == "CardUnhealthy",
        message="the sick pod seen",
    )
    assert gate(cluster, "qwen-a") is None  # the operator wrote nothing on the pod
    assert cluster.kube.calls().count(STATUS_PATCH) == 2  # the test's own two writes
    assert "NoHealthReporter" not in cluster.event_reasons()

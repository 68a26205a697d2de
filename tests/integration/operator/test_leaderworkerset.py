"""The real operator with multi-node services: a LeaderWorkerSet per service where the cluster serves
the kind (create, status, scale, autoscaling, drift, switching, delete), and rejection without it."""

from __future__ import annotations

import copy

import pytest

from tests.integration.operator.conftest import LWS_GROUP, NAMESPACE, Cluster, wait_for
from tests.integration.operator.test_admission import _accepts, review

pytestmark = pytest.mark.slow
VERSIONS = {"driver": "5.0.21.26", "firmware": "1.0.2.14.1.54", "kml": "3.2.0"}
SPEC = {
    "model": {"name": "qwen", "source": {"hostPath": {"path": "/data/qwen"}}, "parameters": "70B"},
    "versions": VERSIONS,
    "runtime": {"tensorParallelSize": 8, "pipelineParallelSize": 2},
    "resources": {"xpus": 8},
}
LEADERS = {
    "app.kubernetes.io/name": "kunlun-runtime",
    "app.kubernetes.io/instance": "qwen",
    "leaderworkerset.sigs.k8s.io/worker-index": "0",
}
INSTALL = "install LeaderWorkerSet (https://lws.sigs.k8s.io"


@pytest.mark.leaderworkerset
def test_multi_node_service_is_a_leaderworkerset_created_scaled_restored_and_deleted(
    cluster: Cluster,
) -> None:
    cluster.add_node("xpu-1")
    cluster.start_operator()
    uid = cluster.create_service(copy.deepcopy(SPEC))["metadata"]["uid"]
    lws = wait_for(cluster.leaderworkerset, message="the LeaderWorkerSet")
    assert lws["metadata"]["ownerReferences"][0]["uid"] == uid
    group = lws["spec"]["leaderWorkerTemplate"]
    assert (lws["spec"]["replicas"], group["size"], group["restartPolicy"]) == (
        1,
        2,
        "RecreateGroupOnPodRestart",
    )
    assert cluster.deployment() is None
    assert cluster.kube.objects("services")[0]["spec"]["selector"] == LEADERS
    wait_for(lambda: cluster.status().get("phase") == "Progressing", message="the status")
    cluster.mark_leaderworkerset_ready()
    wait_for(lambda: cluster.status().get("phase") == "Ready", message="phase Ready")
    assert cluster.status()["ready"] == "1/1"

    cluster.patch_service({"spec": {"replicas": 3}})  # scale: three groups of two pods
    wait_for(lambda: cluster.leaderworkerset()["spec"]["replicas"] == 3, message="three groups")
    wait_for(lambda: cluster.status().get("ready") == "1/3", message="the status of three groups")

    cluster.patch_leaderworkerset({"spec": {"leaderWorkerTemplate": {"size": 4}}})  # drift
    wait_for(lambda: cluster.leaderworkerset()["spec"]["leaderWorkerTemplate"]["size"] == 2, message="size 2")
    cluster.custom.delete_namespaced_custom_object(LWS_GROUP, "v1", NAMESPACE, "leaderworkersets", "qwen-lws")
    wait_for(cluster.leaderworkerset, message="the LeaderWorkerSet recreated")
    cluster.wait_for_events("DriftRestored", 2)

    cluster.custom.delete_namespaced_custom_object(
        "serving.kunlun.dev", "v1alpha1", NAMESPACE, "kunluninferenceservices", "qwen"
    )
    wait_for(
        lambda: cluster.kube.objects("kunluninferenceservices", "serving.kunlun.dev") == [],
        message="the service gone",
    )
    assert cluster.leaderworkerset() is None
    assert cluster.kube.objects("services") == cluster.kube.objects("poddisruptionbudgets", "policy") == []


@pytest.mark.leaderworkerset
def test_autoscaling_scales_the_leaderworkerset_and_switching_replaces_the_workload(cluster: Cluster) -> None:
    cluster.add_node("xpu-1")
    cluster.start_operator()
    single = {k: v for k, v in SPEC.items() if k not in ("runtime", "resources")}
    cluster.create_service(copy.deepcopy(single))
    wait_for(cluster.deployment, message="the Deployment of the single-node service")
    autoscaling = {"enabled": True, "minReplicas": 1, "maxReplicas": 4}
    cluster.patch_service(
        {"spec": {"runtime": SPEC["runtime"], "resources": SPEC["resources"], "autoscaling": autoscaling}}
    )
    wait_for(lambda: cluster.leaderworkerset() and cluster.deployment() is None, message="the LWS instead")
    hpa = wait_for(
        lambda: cluster.kube.objects("horizontalpodautoscalers", "autoscaling"), message="the HPA"
    )[0]
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "name": "qwen-lws",
    }
    # The HPA scales the LeaderWorkerSet; the operator keeps that count.
    cluster.patch_leaderworkerset({"spec": {"replicas": 3}})
    cluster.core.patch_node("xpu-1", {"metadata": {"labels": {"kunlun.dev/xpu.count": "4"}}})  # wakes it
    wait_for(lambda: cluster.status().get("ready") == "0/3", message="status from the HPA's count")
    assert cluster.leaderworkerset()["spec"]["replicas"] == 3
    cluster.patch_service(
        {"spec": {"runtime": {"pipelineParallelSize": 1}, "autoscaling": {"enabled": False}}}
    )
    wait_for(
        lambda: cluster.deployment() and cluster.leaderworkerset() is None, message="back to a Deployment"
    )
    assert (
        "leaderworkerset.sigs.k8s.io/worker-index"
        not in cluster.kube.objects("services")[0]["spec"]["selector"]
    )


def test_without_leaderworkerset_a_multi_node_service_is_rejected_and_reported(cluster: Cluster) -> None:
    cluster.add_node("xpu-1")
    operator = cluster.start_operator()
    wait_for(lambda: _accepts(operator.webhook_port), message="the webhook server")
    verdict = review(operator.webhook_port, copy.deepcopy(SPEC))
    assert verdict["allowed"] is False
    message = verdict["status"]["message"]
    assert message.startswith("spec.runtime.pipelineParallelSize: 2 nodes per replica need LeaderWorkerSet")
    assert INSTALL in message
    single = {**SPEC, "runtime": {"tensorParallelSize": 8}}  # the same cards on one node
    assert review(operator.webhook_port, copy.deepcopy(single))["allowed"] is True

    cluster.create_service(copy.deepcopy(SPEC))  # no webhook in front of the fake API
    wait_for(lambda: cluster.condition("Ready"), message="the Ready condition")
    status, reason, text = cluster.condition("Ready")
    assert (status, reason, cluster.status()["phase"]) == ("False", "LeaderWorkerSetNotInstalled", "Failed")
    assert INSTALL in text
    cluster.wait_for_events("LeaderWorkerSetNotInstalled")
    owned = [
        ("configmaps", ""),
        ("services", ""),
        ("deployments", "apps"),
        ("poddisruptionbudgets", "policy"),
    ]
    assert [cluster.kube.objects(p, g) for p, g in owned] == [[], [], [], []]


@pytest.mark.leaderworkerset
def test_no_leaderworkerset_flag_rejects_multi_node_even_where_lws_is_served(cluster: Cluster) -> None:
    cluster.add_node("xpu-1")
    operator = cluster.start_operator("--no-leaderworkerset")
    wait_for(lambda: _accepts(operator.webhook_port), message="the webhook server")
    assert review(operator.webhook_port, copy.deepcopy(SPEC))["allowed"] is False
    cluster.create_service(copy.deepcopy(SPEC))
    wait_for(lambda: cluster.condition("Ready"), message="the Ready condition")
    assert cluster.condition("Ready")[1] == "LeaderWorkerSetNotInstalled"
    assert cluster.leaderworkerset() is None
    assert not [c for c in cluster.kube.calls() if c[1] == LWS_GROUP]  # no rights needed: never called

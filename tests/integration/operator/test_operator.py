"""The real operator against the fake API: create, rollout, nodes, drift, faults, restart, delete."""

from __future__ import annotations

import copy
import urllib.request

import pytest

from tests.integration.operator.conftest import NAMESPACE, Cluster, free_port, wait_for

pytestmark = pytest.mark.slow
VERSIONS = {"driver": "5.0.21.26", "firmware": "1.0.2.14.1.54", "kml": "3.2.0"}
SPEC = {
    "model": {"name": "qwen", "source": {"hostPath": {"path": "/data/qwen"}}, "parameters": "7B"},
    "versions": VERSIONS,
}
OWNED = [("configmaps", ""), ("services", ""), ("deployments", "apps"), ("poddisruptionbudgets", "policy")]


def _names(cluster: Cluster, plural: str, group: str = "") -> list[str]:
    return sorted(o["metadata"]["name"] for o in cluster.kube.objects(plural, group))


@pytest.mark.monitoring
def test_create_builds_every_object_and_reports_status(cluster: Cluster) -> None:
    cluster.add_node("xpu-1")
    metrics_port = free_port()
    cluster.start_operator("--metrics-port", str(metrics_port), "--preflight-xpu-smi", "/opt/xpu/bin/xpu-smi")
    created = cluster.create_service(copy.deepcopy(SPEC))
    wait_for(lambda: cluster.status().get("phase") == "Progressing", message="the status")
    uid = created["metadata"]["uid"]
    # no runtime.image: the packaged matrix entry's kunlun image, also for the Strict preflight,
    # which mounts the node's KML version file and the xpu-smi the operator was given
    pod = cluster.kube.objects("deployments", "apps")[0]["spec"]["template"]["spec"]
    assert {c["image"] for c in [*pod["initContainers"], *pod["containers"]]} == {
        "ghcr.io/kunlun-inference/kunlun-runtime:0.1.0-kunlun"
    }
    assert [v["hostPath"] for v in pod["volumes"] if "hostPath" in v] == [
        {"path": "/data/qwen", "type": "Directory"},  # the model
        {"path": "/usr/local/xpu/kml", "type": ""},  # the KML version file's directory, unchecked
        {"path": "/opt/xpu/bin/xpu-smi", "type": "File"},
    ]
    for plural, group in [
        *OWNED,
        ("servicemonitors", "monitoring.coreos.com"),
        ("prometheusrules", "monitoring.coreos.com"),
    ]:
        objs = cluster.kube.objects(plural, group)
        assert [o["metadata"]["name"] for o in objs] == ["qwen-config" if plural == "configmaps" else "qwen"]
        assert objs[0]["metadata"]["ownerReferences"][0]["uid"] == uid
    assert cluster.kube.objects("horizontalpodautoscalers", "autoscaling") == []
    status = cluster.status()
    assert (status["compatibleNodes"], status["ready"], status["observedGeneration"]) == (1, "0/1", 1)
    assert status["endpoint"] == "http://qwen.ml.svc:8000/v1"
    assert cluster.condition("DevicesAvailable") == ("True", "CompatibleNodesFound", "1 node(s) match: xpu-1")

    cluster.mark_deployment_ready()
    wait_for(lambda: cluster.status().get("phase") == "Ready", message="phase Ready")
    assert cluster.status()["ready"] == "1/1"
    assert cluster.condition("ModelAvailable")[:2] == ("True", "ModelLoaded")
    cluster.wait_for_events("Created", 6)
    cluster.wait_for_events("Ready")
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
        metrics = response.read().decode()
    assert 'kunlun_operator_managed_services{phase="Ready"} 1.0' in metrics
    assert 'kunlun_operator_object_changes_total{action="created",kind="Deployment"} 1.0' in metrics
    assert 'kunlun_operator_reconcile_total{result="success"}' in metrics
    assert "kunlun_operator_reconcile_duration_seconds_count" in metrics
    assert "finalizer" in str(cluster.get_service()["metadata"]["finalizers"])


def test_spec_change_rolls_the_pods(cluster: Cluster) -> None:
    cluster.add_node("xpu-1")
    cluster.start_operator()
    cluster.create_service(copy.deepcopy(SPEC))
    first = wait_for(cluster.deployment, message="the deployment")
    before = first["spec"]["template"]["metadata"]["annotations"]["serving.kunlun.dev/config-hash"]
    cluster.patch_service({"spec": {"runtime": {"maxModelLen": 4096}}})

    def rolled() -> dict | None:
        d = cluster.deployment()
        return d if "--max-model-len" in d["spec"]["template"]["spec"]["containers"][0]["args"] else None

    after = wait_for(rolled, message="the new pod template")
    assert after["spec"]["template"]["metadata"]["annotations"]["serving.kunlun.dev/config-hash"] != before
    assert after["metadata"]["generation"] == first["metadata"]["generation"] + 1
    configmap = cluster.kube.objects("configmaps")[0]
    assert "max-model-len: 4096" in configmap["data"]["config.yaml"]
    wait_for(lambda: cluster.status().get("observedGeneration") == 2, message="status of generation 2")
    cluster.wait_for_events("Updated", 2)  # the ConfigMap and the Deployment


def test_node_label_changes_update_compatible_nodes_and_conditions(cluster: Cluster) -> None:
    cluster.add_node("xpu-1")
    cluster.add_node("xpu-2")
    cluster.start_operator()
    cluster.create_service(copy.deepcopy(SPEC))
    wait_for(lambda: cluster.status().get("compatibleNodes") == 2, message="2 compatible nodes")
    for node in ("xpu-1", "xpu-2"):
        cluster.core.patch_node(node, {"metadata": {"labels": {"kunlun.dev/xpu.driver-version": "5.0.20"}}})
    wait_for(lambda: cluster.status().get("compatibleNodes") == 0, message="no compatible nodes")
    assert cluster.condition("DevicesAvailable") == (
        "False",
        "NoCompatibleNodes",
        "no Kunlun node matches driver=5.0.21.26 firmware=1.0.2.14.1.54 kml=3.2.0 xpus>=1; Kunlun nodes have: "
        "driver=5.0.20 firmware=1.0.2.14.1.54 kml=3.2.0 product=P800 xpus=8 (2 nodes)",
    )
    assert cluster.status()["phase"] == "Pending"
    cluster.wait_for_events("NoCompatibleNodes")
    cluster.core.patch_node("xpu-2", {"metadata": {"labels": {"kunlun.dev/xpu.driver-version": "5.0.21.26"}}})
    wait_for(lambda: cluster.status().get("compatibleNodes") == 1, message="one compatible node again")
    assert cluster.condition("DevicesAvailable")[:2] == ("True", "CompatibleNodesFound")


def test_owned_objects_changed_or_deleted_by_hand_are_restored(cluster: Cluster) -> None:
    cluster.add_node("xpu-1")
    cluster.start_operator()
    cluster.create_service(copy.deepcopy(SPEC))
    wait_for(lambda: cluster.status().get("phase"), message="the status")
    old_uid = cluster.kube.objects("services")[0]["metadata"]["uid"]
    cluster.core.delete_namespaced_service("qwen", NAMESPACE)
    wait_for(
        lambda: [s for s in cluster.kube.objects("services") if s["metadata"]["uid"] != old_uid],
        message="the Service back",
    )
    cluster.apps.patch_namespaced_deployment(
        "qwen",
        NAMESPACE,
        {"spec": {"replicas": 5, "template": {"spec": {"terminationGracePeriodSeconds": 1}}}},
    )

    def restored() -> bool:
        d = cluster.deployment()
        return (
            d["spec"]["replicas"] == 1
            and d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 90
        )

    wait_for(restored, message="the Deployment restored")
    cluster.wait_for_events("DriftRestored", 2)
    assert _names(cluster, "services") == ["qwen"]


def test_conflicts_and_server_errors_are_retried(cluster: Cluster) -> None:
    cluster.add_node("xpu-1")
    service_fault = cluster.kube.fail("create", "services", status=500, times=2)
    status_fault = cluster.kube.fail(
        "patch", "kunluninferenceservices", status=409, times=1, subresource="status"
    )
    cluster.start_operator()
    cluster.create_service(copy.deepcopy(SPEC))
    wait_for(lambda: cluster.status().get("phase") == "Progressing", message="the status despite the faults")
    assert (service_fault.fired, status_fault.fired) == (2, 1)
    assert [_names(cluster, p, g) for p, g in OWNED] == [["qwen-config"], ["qwen"], ["qwen"], ["qwen"]]
    assert "retry 1 in" in cluster.operators[0].log()


def test_restart_in_the_middle_of_a_reconcile_converges_without_duplicates(cluster: Cluster) -> None:
    cluster.add_node("xpu-1")
    cluster.kube.fail("create", "deployments", status=503, times=None)  # the pass stops half-way
    first = cluster.start_operator()
    cluster.create_service(copy.deepcopy(SPEC))
    wait_for(
        lambda: (
            _names(cluster, "services") == ["qwen"]
            and ("create", "apps", "deployments", NAMESPACE) in cluster.kube.calls()
        ),
        message="a half-done reconcile",
    )
    first.kill()
    assert cluster.deployment() is None
    cluster.kube.clear_faults()
    second = cluster.start_operator()
    wait_for(cluster.deployment, message="the Deployment from the new operator")
    wait_for(lambda: cluster.status().get("phase") == "Progressing", message="the status")
    assert [_names(cluster, p, g) for p, g in OWNED] == [["qwen-config"], ["qwen"], ["qwen"], ["qwen"]]
    assert "Deployment created" in second.log()
    assert "ConfigMap created" not in second.log() and "Service created" not in second.log()


def test_deleting_the_service_deletes_what_it_owns(cluster: Cluster) -> None:
    cluster.add_node("xpu-1")
    cluster.start_operator()
    cluster.create_service(copy.deepcopy(SPEC))
    wait_for(lambda: all(cluster.kube.objects(p, g) for p, g in OWNED), message="the objects")
    cluster.custom.delete_namespaced_custom_object(
        "serving.kunlun.dev", "v1alpha1", NAMESPACE, "kunluninferenceservices", "qwen"
    )
    wait_for(
        lambda: cluster.kube.objects("kunluninferenceservices", "serving.kunlun.dev") == [],
        message="the service gone",
    )
    assert [cluster.kube.objects(p, g) for p, g in OWNED] == [[], [], [], []]
    cluster.wait_for_events("Deleted", 4)


def test_autoscaling_leaves_the_replica_count_to_the_hpa(cluster: Cluster) -> None:
    cluster.add_node("xpu-1")
    operator = cluster.start_operator()
    autoscaling = {"enabled": True, "minReplicas": 2, "maxReplicas": 5}
    cluster.create_service({**copy.deepcopy(SPEC), "autoscaling": autoscaling})
    hpa = wait_for(
        lambda: cluster.kube.objects("horizontalpodautoscalers", "autoscaling"), message="the HPA"
    )[0]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 5)
    assert wait_for(cluster.deployment, message="the Deployment")["spec"]["replicas"] == 2
    # The HPA scales the Deployment, even while a reconcile may be running.
    cluster.apps.patch_namespaced_deployment("qwen", NAMESPACE, {"spec": {"replicas": 4}})
    passes = operator.log().count("reconciled ml/qwen")
    cluster.core.patch_node("xpu-1", {"metadata": {"labels": {"kunlun.dev/xpu.count": "4"}}})  # wakes it
    wait_for(lambda: operator.log().count("reconciled ml/qwen") > passes, message="another reconcile")
    assert cluster.deployment()["spec"]["replicas"] == 4
    wait_for(lambda: cluster.status().get("ready") == "0/4", message="status from the HPA's count")


def test_warn_policy_reports_pods_on_mismatching_nodes(cluster: Cluster) -> None:
    cluster.add_node("old", **{"kunlun.dev/xpu.kml-version": "3.1.0"})
    labels = {"app.kubernetes.io/name": "kunlun-runtime", "app.kubernetes.io/instance": "qwen"}
    cluster.core.create_namespaced_pod(
        NAMESPACE,
        {
            "metadata": {"name": "qwen-abc", "labels": labels},
            "spec": {"nodeName": "old", "containers": [{"name": "runtime", "image": "rt"}]},
        },
    )
    cluster.start_operator()
    spec = copy.deepcopy(SPEC)
    spec["versions"]["policy"] = "Warn"
    cluster.create_service(spec)
    wait_for(lambda: cluster.condition("VersionsCompatible"), message="the version condition")
    assert cluster.condition("VersionsCompatible") == (
        "False",
        "PodsOnMismatchedNodes",
        "qwen-abc on old: kml 3.1.0 (want 3.2.0)",
    )
    assert "affinity" not in cluster.deployment()["spec"]["template"]["spec"]
    cluster.wait_for_events("PodsOnMismatchedNodes")

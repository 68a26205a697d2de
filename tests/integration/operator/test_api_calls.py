"""Every Kubernetes API call the operator makes is in the documented table (the chart's RBAC).

The fake API records each call as (verb, group, resource); one run walks the operator through every
code path that talks to the API (create, autoscaling on and off, Warn policy, a PVC source, the
matrix ConfigMap, a node change, drift, a replica on a failed card evicted, a readiness gate nobody
reported on set by the operator, admission, deletion).
The observed table must equal ``kunlun_operator/api_calls.yaml`` minus the peering rules (tests
run standalone), the LeaderWorkerSet rules, which a second run (a multi-node service on a cluster
serving LeaderWorkerSet: create, scale, autoscaling, drift, deletion) must make exactly, and the
routing rules, which a third run (a routed service on a cluster serving InferencePool and HTTPRoute:
create, drift put back after a restart, switching back to the Service, deletion) must make exactly,
but for the rights the operator holds only to grant them to the Endpoint Picker, and the DRA rules,
which a fourth run (with --dra: a service with allocation dra created, its claim changed, switched
back to the device plugin, dra again, deleted) must make exactly, and the LoRA rules, which a fifth
run (a service loading its adapters at run time with an API key) must make exactly.
"""

from __future__ import annotations

import copy
from importlib import resources

import kubernetes
import pytest
import yaml

from tests.integration.operator.conftest import LWS_GROUP, NAMESPACE, Cluster, add_failed_pod, wait_for
from tests.integration.operator.test_admission import _accepts, review
from tests.integration.operator.test_health_gate import add_pod, ago, kubelet_ready

pytestmark = pytest.mark.slow
SPEC = {
    "model": {"name": "qwen", "source": {"pvc": {"claimName": "models", "path": "qwen"}}},
    "versions": {"driver": "5.0.21.26", "firmware": "1.0.2.14.1.54", "kml": "3.2.0", "policy": "Warn"},
    "autoscaling": {"enabled": True, "maxReplicas": 3},
    "faultTolerance": {"replaceAfter": "1s"},
}
MULTI_NODE = {
    "model": {"name": "qwen", "source": {"hostPath": {"path": "/data/qwen"}}},
    "versions": {"driver": "5.0.21.26", "firmware": "1.0.2.14.1.54", "kml": "3.2.0"},
    "runtime": {"tensorParallelSize": 8, "pipelineParallelSize": 2},
    "resources": {"xpus": 8},
}


def add_unreported_pod(cluster: Cluster) -> None:
    """A runtime pod with the readiness gate, ready for ten minutes, that no device plugin reported on."""
    add_pod(cluster, "qwen-unreported")
    kubelet_ready(cluster, "qwen-unreported", since=ago(600))


def documented(
    *, leaderworkerset: bool = False, routing: bool = False, dra: bool = False, lora: bool = False
) -> set[tuple[str, str, str]]:
    """The table's calls, without the peering rules and the rights held only to grant them (``grant``);
    only the ``leaderworkerset``, the ``routing``, the ``dra`` or the ``lora`` rules when asked."""
    text = resources.files("kunlun_operator").joinpath("api_calls.yaml").read_text()
    return {
        (rule["group"], res, verb)
        for rule in yaml.safe_load(text)
        if not rule.get("peering")
        and not rule.get("grant")
        and bool(rule.get("lora")) == lora
        and bool(rule.get("leaderworkerset")) == leaderworkerset
        and bool(rule.get("routing")) == routing
        and bool(rule.get("dra")) == dra
        for res in rule["resources"]
        for verb in rule["verbs"]
    }


@pytest.mark.monitoring
def test_the_operator_calls_exactly_the_documented_api(cluster: Cluster) -> None:
    cluster.add_node("xpu-1")
    cluster.core.create_namespaced_config_map(
        "kunlun-system",
        {
            "metadata": {"name": "matrix"},
            "data": {
                "matrix.yaml": "entries:\n"
                "- {runtime: 0.1.0, driver: [5.0.21.26], firmware: [1.0.2.14.1.54], kml: [3.2.0]}\n"
            },
        },
    )
    operator = cluster.start_operator("--compatibility-configmap", "kunlun-system/matrix")
    cluster.create_service(copy.deepcopy(SPEC))
    wait_for(lambda: cluster.kube.objects("horizontalpodautoscalers", "autoscaling"), message="the HPA")
    wait_for(lambda: cluster.kube.objects("prometheusrules", "monitoring.coreos.com"), message="the objects")
    add_failed_pod(cluster)  # watched, listed, then evicted
    wait_for(lambda: cluster.status().get("replicaReplacements") == 1, message="the replica replaced")
    add_unreported_pod(cluster)  # its readiness gate set by the operator (pods/status)
    wait_for(
        lambda: (cluster.condition("CardHealthReported") or ("", ""))[1] == "NoHealthReporter",
        message="the gate opened",
    )
    cluster.patch_service(
        {
            "spec": {
                "autoscaling": {"maxReplicas": 4},
                "service": {"port": 80},
                "runtime": {"maxModelLen": 2048},
                "disruption": {"maxUnavailable": 2},
                "monitoring": {"labels": {"release": "prom"}},
            }
        }
    )
    wait_for(lambda: cluster.event_reasons().count("Updated") == 7, message="every object updated")
    cluster.patch_service({"spec": {"autoscaling": {"enabled": False}}})
    wait_for(
        lambda: not cluster.kube.objects("horizontalpodautoscalers", "autoscaling"), message="the HPA deleted"
    )
    cluster.core.patch_node("xpu-1", {"metadata": {"labels": {"kunlun.dev/xpu.kml-version": "3.1.0"}}})
    wait_for(lambda: cluster.status().get("compatibleNodes") == 0, message="no compatible node")
    cluster.core.delete_namespaced_config_map("qwen-config", NAMESPACE)
    wait_for(
        lambda: [c for c in cluster.kube.objects("configmaps") if c["metadata"]["name"] == "qwen-config"],
        message="the ConfigMap restored",
    )
    wait_for(lambda: _accepts(operator.webhook_port), message="the webhook server")
    assert review(operator.webhook_port, copy.deepcopy(SPEC))["allowed"] is True
    cluster.custom.delete_namespaced_custom_object(
        "serving.kunlun.dev", "v1alpha1", NAMESPACE, "kunluninferenceservices", "qwen"
    )
    wait_for(
        lambda: not cluster.kube.objects("kunluninferenceservices", "serving.kunlun.dev"),
        message="the service gone",
    )

    observed = {(group, resource, verb) for verb, group, resource, _ in cluster.kube.calls()}
    # The test's own calls (it plays the user and the kubelet) are not the operator's.
    mine = {
        ("", "nodes", "create"),
        ("", "nodes", "patch"),
        ("", "configmaps", "create"),
        ("", "pods", "create"),
        ("", "pods/status", "patch"),
        ("serving.kunlun.dev", "kunluninferenceservices", "create"),
        ("serving.kunlun.dev", "kunluninferenceservices", "delete"),
    }
    operator_calls = {call for call in observed if call not in mine or call in documented()}
    table = "\n".join(f"{g or 'core'} {r} {v}" for g, r, v in sorted(operator_calls))
    assert operator_calls - documented() == set(), f"undocumented calls:\n{table}"
    assert documented() - operator_calls == set(), f"documented but never made:\n{table}"


@pytest.mark.leaderworkerset
def test_a_multi_node_service_makes_exactly_the_documented_leaderworkerset_calls(cluster: Cluster) -> None:
    cluster.add_node("xpu-1")
    cluster.start_operator()
    cluster.create_service(copy.deepcopy(MULTI_NODE))
    wait_for(cluster.leaderworkerset, message="the LeaderWorkerSet")
    cluster.patch_service({"spec": {"replicas": 2}})
    wait_for(lambda: cluster.leaderworkerset()["spec"]["replicas"] == 2, message="scaled")
    cluster.custom.delete_namespaced_custom_object(LWS_GROUP, "v1", NAMESPACE, "leaderworkersets", "qwen-lws")
    wait_for(cluster.leaderworkerset, message="the LeaderWorkerSet restored")
    cluster.custom.delete_namespaced_custom_object(
        "serving.kunlun.dev", "v1alpha1", NAMESPACE, "kunluninferenceservices", "qwen"
    )
    wait_for(
        lambda: not cluster.kube.objects("kunluninferenceservices", "serving.kunlun.dev"),
        message="the service gone",
    )
    # No garbage collector here: only the operator's cleanup can have deleted it.
    assert cluster.leaderworkerset() is None
    observed = {
        (group, resource, verb) for verb, group, resource, _ in cluster.kube.calls() if group == LWS_GROUP
    }
    assert observed == documented(leaderworkerset=True)


ROUTED = {**MULTI_NODE, "runtime": {}, "resources": {}}
ROUTED["routing"] = {"type": "InferencePool", "gateway": {"name": "inference-gateway"}}
ROUTING_RESOURCES = {"inferencepools", "httproutes", "serviceaccounts", "roles", "rolebindings"}


@pytest.mark.routing
def test_a_routed_service_makes_exactly_the_documented_routing_calls(cluster: Cluster) -> None:
    rbac, inference, gateway = (
        "rbac.authorization.k8s.io",
        "inference.networking.k8s.io",
        "gateway.networking.k8s.io",
    )
    cluster.add_node("xpu-1")
    operator = cluster.start_operator()
    cluster.create_service(copy.deepcopy(ROUTED))
    wait_for(lambda: cluster.kube.objects("httproutes", gateway), message="the routing objects")
    # drift in every routing kind while the operator is down (so every call meanwhile is the test's)
    operator.stop()
    mine_from = len(cluster.kube.calls())
    rbac_api = kubernetes.client.RbacAuthorizationV1Api(cluster.kube.client())
    cluster.core.patch_namespaced_service_account(
        "qwen-epp", NAMESPACE, {"automountServiceAccountToken": True}
    )
    rbac_api.patch_namespaced_role("qwen-epp", NAMESPACE, {"rules": []})
    rbac_api.patch_namespaced_role_binding("qwen-epp", NAMESPACE, {"subjects": []})
    for group, plural, spec in (
        (inference, "inferencepools", {"targetPorts": [{"number": 9999}]}),
        (gateway, "httproutes", {"parentRefs": [{"name": "elsewhere"}]}),
    ):
        cluster.custom.patch_namespaced_custom_object(group, "v1", NAMESPACE, plural, "qwen", {"spec": spec})
    mine_to = len(cluster.kube.calls())
    cluster.start_operator()
    wait_for(
        lambda: (
            [r["rules"] for r in cluster.kube.objects("roles", rbac)] != [[]]
            and cluster.kube.objects("httproutes", gateway)[0]["spec"]["parentRefs"][0]["name"]
            == "inference-gateway"
            and cluster.kube.objects("inferencepools", inference)[0]["spec"]["targetPorts"]
            == [{"number": 8000}]
        ),
        message="the drift put back",
    )
    cluster.patch_service({"spec": {"routing": {"type": "Service", "gateway": None}}})
    wait_for(
        lambda: not cluster.kube.objects("inferencepools", inference), message="the routing objects deleted"
    )
    cluster.custom.delete_namespaced_custom_object(
        "serving.kunlun.dev", "v1alpha1", NAMESPACE, "kunluninferenceservices", "qwen"
    )
    wait_for(
        lambda: not cluster.kube.objects("kunluninferenceservices", "serving.kunlun.dev"),
        message="the service gone",
    )
    calls = cluster.kube.calls()
    observed = {
        (group, resource, verb)
        for verb, group, resource, _ in calls[:mine_from] + calls[mine_to:]
        if resource in ROUTING_RESOURCES
    }
    assert observed == documented(routing=True)


DRA = {**MULTI_NODE, "runtime": {}, "resources": {"allocation": "dra"}}


def test_a_dra_service_makes_exactly_the_documented_dra_calls(cluster: Cluster) -> None:
    group = "resource.k8s.io"
    cluster.add_node("xpu-1")
    cluster.start_operator("--dra")

    def templates() -> list[str]:
        return sorted(o["metadata"]["name"] for o in cluster.kube.objects("resourceclaimtemplates", group))

    cluster.create_service(copy.deepcopy(DRA))
    wait_for(lambda: len(templates()) == 1, message="the claim template")
    first = templates()
    # drift on the template, put back by the next pass (woken here by a change of replicas)
    labels = {"app.kubernetes.io/component": "changed"}
    cluster.custom.patch_namespaced_custom_object(
        group, "v1", NAMESPACE, "resourceclaimtemplates", first[0], {"metadata": {"labels": labels}}
    )
    cluster.patch_service({"spec": {"replicas": 2}})
    wait_for(
        lambda: (
            cluster.kube.objects("resourceclaimtemplates", group)[0]["metadata"]["labels"][
                "app.kubernetes.io/component"
            ]
            == "inference"
        ),
        message="the drift put back",
    )
    cluster.patch_service({"spec": {"resources": {"xpus": 2}}})
    wait_for(lambda: len(templates()) == 1 and templates() != first, message="a new template, the old pruned")
    pods = cluster.deployment()["spec"]["template"]["spec"]  # type: ignore[index]
    assert pods["resourceClaims"] == [{"name": "xpus", "resourceClaimTemplateName": templates()[0]}]
    cluster.patch_service({"spec": {"resources": {"allocation": "devicePlugin"}}})
    wait_for(lambda: templates() == [], message="the template pruned when back on the device plugin")
    cluster.patch_service({"spec": {"resources": {"allocation": "dra"}}})
    wait_for(lambda: len(templates()) == 1, message="the claim template again")
    cluster.custom.delete_namespaced_custom_object(
        "serving.kunlun.dev", "v1alpha1", NAMESPACE, "kunluninferenceservices", "qwen"
    )
    wait_for(lambda: templates() == [], message="the template deleted with the service")
    observed = {(g, resource, verb) for verb, g, resource, _ in cluster.kube.calls() if g == group}
    assert observed == documented(dra=True)
    rules = yaml.safe_load(resources.files("kunlun_operator").joinpath("api_calls.yaml").read_text())
    for rule in rules:
        for plural in rule["resources"] if "fieldSelector" in rule else ():
            assert set(cluster.kube.field_selectors(plural, rule["group"])) == {rule["fieldSelector"]}


LORA = {
    "model": {
        "name": "qwen",
        "source": {"hostPath": {"path": "/data/qwen"}},
        "adapters": [{"name": "sql", "source": {"hostPath": {"path": "/data/sql"}}}],
    },
    "versions": {"driver": "5.0.21.26", "firmware": "1.0.2.14.1.54", "kml": "3.2.0"},
    "runtime": {"lora": {"runtimeUpdates": True}},
    "apiKeySecretRef": {"name": "qwen-key", "key": "token"},
}


def test_a_lora_service_updating_at_run_time_makes_exactly_the_documented_lora_calls(
    cluster: Cluster,
) -> None:
    """The API key is read from its Secret by name (get, never list or watch) for the pods' calls."""
    cluster.add_node("xpu-1")
    cluster.core.create_namespaced_secret(
        NAMESPACE, {"metadata": {"name": "qwen-key"}, "data": {"token": "a2V5"}}
    )
    cluster.start_operator()
    cluster.create_service(copy.deepcopy(LORA))
    wait_for(lambda: cluster.condition("AdaptersReady"), message="the AdaptersReady condition")
    observed = {
        (group, resource, verb)
        for verb, group, resource, _ in cluster.kube.calls()
        if resource == "secrets" and verb != "create"  # the test's own
    }
    assert observed == documented(lora=True)

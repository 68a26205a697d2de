"""Every Kubernetes API call the operator makes is in the documented table (the chart's RBAC).

The fake API records each call as (verb, group, resource); one run walks the operator through every
code path that talks to the API (create, autoscaling on and off, Warn policy, a PVC source, the
matrix ConfigMap, a node change, drift, a replica on a failed card evicted, admission, deletion).
The observed table must equal ``kunlun_operator/api_calls.yaml`` minus the peering rules (tests
run standalone).
"""

from __future__ import annotations

import copy
from importlib import resources

import pytest
import yaml

from tests.integration.operator.conftest import NAMESPACE, Cluster, add_failed_pod, wait_for
from tests.integration.operator.test_admission import _accepts, review

pytestmark = pytest.mark.slow
SPEC = {
    "model": {"name": "qwen", "source": {"pvc": {"claimName": "models", "path": "qwen"}}},
    "versions": {"driver": "5.0.21.26", "firmware": "1.0.2.14.1.54", "kml": "3.2.0", "policy": "Warn"},
    "autoscaling": {"enabled": True, "maxReplicas": 3},
    "faultTolerance": {"replaceAfter": "1s"},
}


def documented() -> set[tuple[str, str, str]]:
    text = resources.files("kunlun_operator").joinpath("api_calls.yaml").read_text()
    return {
        (rule["group"], res, verb)
        for rule in yaml.safe_load(text)
        if not rule.get("peering")
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

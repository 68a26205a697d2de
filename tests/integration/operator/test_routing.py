"""The real operator with routed services (``spec.routing.type: InferencePool``): the pool, the
Endpoint Picker and the route are created with owner references, ``Routed`` follows the picker and
the Gateway's verdict, a deleted pool is put back, switching back to the Service deletes them all,
and a cluster without the APIs gets the service refused naming the missing API."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kunlun_operator import names
from tests.integration.operator.conftest import NAMESPACE, Cluster, wait_for
from tests.integration.operator.test_admission import _accepts, review

pytestmark = pytest.mark.slow
INFERENCE_GROUP, GATEWAY_GROUP = "inference.networking.k8s.io", "gateway.networking.k8s.io"
SPEC = {
    "model": {"name": "qwen", "source": {"hostPath": {"path": "/data/qwen"}}},
    "versions": {"driver": "5.0.21.26", "firmware": "1.0.2.14.1.54", "kml": "3.2.0"},
    "replicas": 3,
    "routing": {"type": "InferencePool", "precise": True, "gateway": {"name": "inference-gateway"}},
}
#: Every routing object of the service qwen: (plural, group, name).
ROUTING_OBJECTS = [
    ("serviceaccounts", "", "qwen-epp"),
    ("roles", "rbac.authorization.k8s.io", "qwen-epp"),
    ("rolebindings", "rbac.authorization.k8s.io", "qwen-epp"),
    ("configmaps", "", "qwen-epp"),
    ("deployments", "apps", "qwen-epp"),
    ("services", "", "qwen-epp"),
    ("inferencepools", INFERENCE_GROUP, "qwen"),
    ("httproutes", GATEWAY_GROUP, "qwen"),
]


def find(cluster: Cluster, plural: str, group: str, name: str) -> dict[str, Any] | None:
    found = [o for o in cluster.kube.objects(plural, group) if o["metadata"]["name"] == name]
    return found[0] if found else None


def routed(cluster: Cluster) -> tuple[str, str] | None:
    condition = cluster.condition("Routed")
    return None if condition is None else condition[:2]


@pytest.mark.routing
def test_a_routed_service_gets_its_pool_picker_and_route_and_loses_them_when_switched_back(
    cluster: Cluster,
) -> None:
    cluster.add_node("xpu-1")
    cluster.start_operator()
    uid = cluster.create_service(copy.deepcopy(SPEC))["metadata"]["uid"]
    wait_for(lambda: all(find(cluster, *o) for o in ROUTING_OBJECTS), message="every routing object")
    for plural, group, name in ROUTING_OBJECTS:
        owner = find(cluster, plural, group, name)["metadata"]["ownerReferences"]
        assert [(r["kind"], r["uid"], r["controller"]) for r in owner] == [
            ("KunlunInferenceService", uid, True)
        ]
    pool = find(cluster, "inferencepools", INFERENCE_GROUP, "qwen")
    assert pool["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "kunlun-runtime",
        "app.kubernetes.io/instance": "qwen",
    }
    assert pool["spec"]["endpointPickerRef"]["name"] == "qwen-epp"
    route = find(cluster, "httproutes", GATEWAY_GROUP, "qwen")
    assert route["spec"]["parentRefs"][0]["name"] == "inference-gateway"
    runtime = cluster.deployment()["spec"]["template"]["spec"]["containers"][0]
    assert "kv-events" in {p["name"] for p in runtime["ports"]}

    # the picker turns ready (the test plays the Deployment controller), then the gateway accepts
    wait_for(lambda: routed(cluster) == ("False", "PickerNotReady"), message="Routed: picker not ready")
    cluster.mark_deployment_ready("qwen-epp")
    wait_for(
        lambda: routed(cluster) == ("Unknown", "AwaitingGateway"), message="Routed: awaiting the gateway"
    )
    accepted = {
        "type": "Accepted",
        "status": "True",
        "reason": "Accepted",
        "message": "",
        "lastTransitionTime": "2026-01-01T00:00:00Z",
    }
    parent = {"parentRef": {"name": "inference-gateway"}, "conditions": [accepted]}
    # a Gateway refusing the route says so in the route's status only; the reconcile reads it (here
    # on the pool's status change, which it watches)
    refused = {**accepted, "status": "False", "reason": "NotAllowedByListeners"}
    route_parent = {"parentRef": {"name": "inference-gateway"}, "conditions": [refused]}
    cluster.custom.patch_namespaced_custom_object_status(
        GATEWAY_GROUP, "v1", NAMESPACE, "httproutes", "qwen", {"status": {"parents": [route_parent]}}
    )
    cluster.custom.patch_namespaced_custom_object_status(
        INFERENCE_GROUP, "v1", NAMESPACE, "inferencepools", "qwen", {"status": {"parents": [parent]}}
    )
    wait_for(lambda: routed(cluster) == ("False", "GatewayRejectedRoute"), message="Routed: route refused")
    cluster.custom.patch_namespaced_custom_object_status(
        GATEWAY_GROUP, "v1", NAMESPACE, "httproutes", "qwen", {"status": {"parents": [parent]}}
    )
    later = {**parent, "conditions": [{**accepted, "lastTransitionTime": "2026-01-01T00:01:00Z"}]}
    cluster.custom.patch_namespaced_custom_object_status(
        INFERENCE_GROUP, "v1", NAMESPACE, "inferencepools", "qwen", {"status": {"parents": [later]}}
    )
    wait_for(lambda: routed(cluster) == ("True", "GatewayAccepted"), message="Routed: accepted")
    cluster.wait_for_events("GatewayAccepted")

    # a pool deleted by hand is put back (the operator watches its InferencePools)
    cluster.custom.delete_namespaced_custom_object(INFERENCE_GROUP, "v1", NAMESPACE, "inferencepools", "qwen")
    wait_for(lambda: find(cluster, "inferencepools", INFERENCE_GROUP, "qwen"), message="the pool restored")

    # switching back to the Service deletes every routing object, and the condition
    cluster.patch_service({"spec": {"routing": {"type": "Service", "precise": False, "gateway": None}}})
    wait_for(
        lambda: not any(find(cluster, *o) for o in ROUTING_OBJECTS), message="the routing objects deleted"
    )
    wait_for(lambda: routed(cluster) is None, message="no Routed condition")
    runtime = cluster.deployment()["spec"]["template"]["spec"]["containers"][0]
    assert [p["name"] for p in runtime["ports"]] == ["http"]
    assert cluster.deployment() is not None and find(cluster, "services", "", "qwen") is not None


@pytest.mark.routing
def test_deleting_a_routed_service_deletes_its_routing_objects(cluster: Cluster) -> None:
    cluster.add_node("xpu-1")
    cluster.start_operator()
    cluster.create_service(copy.deepcopy(SPEC))
    wait_for(lambda: all(find(cluster, *o) for o in ROUTING_OBJECTS), message="every routing object")
    cluster.custom.delete_namespaced_custom_object(
        "serving.kunlun.dev", "v1alpha1", NAMESPACE, "kunluninferenceservices", "qwen"
    )
    wait_for(
        lambda: not cluster.kube.objects("kunluninferenceservices", "serving.kunlun.dev"),
        message="the service gone",
    )
    # no garbage collector here: only the operator's cleanup can have deleted them
    assert [o for o in ROUTING_OBJECTS if find(cluster, *o)] == []


def test_without_the_inferencepool_api_a_routed_service_is_refused_naming_it(cluster: Cluster) -> None:
    cluster.add_node("xpu-1")
    port = cluster.start_operator().webhook_port
    wait_for(lambda: _accepts(port), message="the webhook server")
    answer = review(port, copy.deepcopy(SPEC))
    assert answer["allowed"] is False
    message = answer["status"]["message"]
    assert message.startswith("spec.routing.type: InferencePool routing needs the InferencePool API ")
    assert "(inference.networking.k8s.io/v1), which this cluster does not serve" in message
    # admitted anyway (no webhook in front of this fake API): Failed with the same words, nothing built
    cluster.create_service(copy.deepcopy(SPEC))
    wait_for(lambda: cluster.status().get("phase") == "Failed", message="phase Failed")
    assert cluster.condition("Ready") == ("False", "InferencePoolNotInstalled", message)
    assert cluster.deployment() is None
    assert review(port, {**copy.deepcopy(SPEC), "routing": {"type": "Service"}})["allowed"] is True


def test_names_used_here_are_the_operators() -> None:
    assert names.owned_name("qwen", names.PICKER_DEPLOYMENT) == "qwen-epp"
    assert [(k.plural, k.api_version.rpartition("/")[0]) for k in names.ROUTING_KINDS] == [
        (plural, group) for plural, group, _ in ROUTING_OBJECTS
    ]

"""A ``dra`` service on the fake API with the real operator: the DRA plugin's ResourceSlice (built by
``kunlun_device.dra.slices`` from a fixture host) decides ``DevicesAvailable``, and a runtime pod the
scheduler left Pending on its claim is named in the condition and a Warning event; without ``--dra``
the webhook refuses the service naming the field."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes
import pytest

from tests.integration.operator.conftest import NAMESPACE, RUNTIME_POD_LABELS, Cluster, wait_for
from tests.integration.operator.test_admission import _accepts, review
from tests.unit.operator.test_dra_cel import node_slice

pytestmark = pytest.mark.slow
GROUP = "resource.k8s.io"
SPEC = {
    "model": {"name": "qwen", "source": {"hostPath": {"path": "/data/qwen"}}},
    "versions": {"driver": "5.0.21.26", "firmware": "1.0.2.14.1.54", "kml": "3.2.0"},
    "runtime": {"tensorParallelSize": 2},
    "resources": {"xpus": 2, "allocation": "dra"},
}


def publish(cluster: Cluster, resource_slice: dict[str, Any]) -> None:
    custom = kubernetes.client.CustomObjectsApi(cluster.kube.client())
    custom.create_cluster_custom_object(GROUP, "v1", "resourceslices", resource_slice)


def add_pending_pod(cluster: Cluster, template: str) -> None:
    pod = {
        "metadata": {"name": "qwen-7d9f-abcde", "labels": RUNTIME_POD_LABELS},
        "spec": {
            "containers": [],
            "resourceClaims": [{"name": "xpus", "resourceClaimTemplateName": template}],
        },
    }
    cluster.core.create_namespaced_pod(NAMESPACE, pod)
    status = {
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/1 nodes are available: 1 cannot allocate all claims.",
            }
        ],
        "resourceClaimStatuses": [{"name": "xpus", "resourceClaimName": "qwen-7d9f-abcde-xpus-k2x4p"}],
    }
    cluster.core.patch_namespaced_pod_status("qwen-7d9f-abcde", NAMESPACE, {"status": status})


def test_devices_available_follows_the_slices_and_names_an_unschedulable_claim(cluster: Cluster) -> None:
    cluster.add_node("node-a")
    cluster.start_operator("--dra")
    cluster.create_service(copy.deepcopy(SPEC))
    wait_for(lambda: (cluster.condition("DevicesAvailable") or ("",))[0] == "False", message="a first pass")
    assert cluster.condition("DevicesAvailable")[1] == "NoResourceSlices"  # type: ignore[index]

    reflashed = node_slice(firmware={i: "1.0.2.14.1.50" for i in range(8)})
    publish(cluster, reflashed)
    template = cluster.kube.objects("resourceclaimtemplates", GROUP)[0]["metadata"]["name"]
    add_pending_pod(cluster, template)  # its change wakes the service
    wait_for(
        lambda: (cluster.condition("DevicesAvailable") or ("", ""))[1] == "ClaimsUnschedulable",
        message="the unschedulable claim named",
    )
    status, _, message = cluster.condition("DevicesAvailable")  # type: ignore[misc]
    assert status == "False"
    assert message == (
        "no device matches firmwareVersion 1.0.2.14.1.54: the 8 device(s) on 1 node(s) publish firmwareVersion "
        "1.0.2-14.1.50 (8): pod qwen-7d9f-abcde's claim qwen-7d9f-abcde-xpus-k2x4p: 0/1 nodes are available: "
        "1 cannot allocate all claims."
    )
    cluster.wait_for_events("ClaimsUnschedulable")


def test_without_dra_the_webhook_refuses_a_dra_service_naming_the_field(cluster: Cluster) -> None:
    port = cluster.start_operator().webhook_port
    wait_for(lambda: _accepts(port), message="the webhook server")
    answer = review(port, copy.deepcopy(SPEC))
    assert answer["allowed"] is False
    assert answer["status"]["message"].startswith(
        "spec.resources.allocation: dra needs Dynamic Resource Allocation"
    )


def foreign_slice() -> dict[str, Any]:
    """A ResourceSlice of another driver on the same node."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "node-a-gpu"},
        "spec": {
            "driver": "gpu.example.com",
            "nodeName": "node-a",
            "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "gpu-0"}],
        },
    }


def test_the_fake_api_lists_resource_slices_by_driver_and_refuses_other_fields(cluster: Cluster) -> None:
    publish(cluster, node_slice())
    publish(cluster, foreign_slice())
    custom = kubernetes.client.CustomObjectsApi(cluster.kube.client())

    def listed(selector: str) -> list[str]:
        found = custom.list_cluster_custom_object(GROUP, "v1", "resourceslices", field_selector=selector)
        return [item["metadata"]["name"] for item in found["items"]]

    assert listed("spec.driver=xpu.kunlun.dev") == ["node-a-xpu.kunlun.dev"]
    assert listed("spec.driver!=xpu.kunlun.dev") == ["node-a-gpu"]
    with pytest.raises(kubernetes.client.ApiException) as refused:
        listed("spec.devices=x")
    assert refused.value.status == 400


def test_the_operator_lists_only_its_drivers_resource_slices(cluster: Cluster) -> None:
    cluster.add_node("node-a")
    publish(cluster, node_slice())
    publish(cluster, foreign_slice())
    cluster.start_operator("--dra")
    cluster.create_service(copy.deepcopy(SPEC))
    wait_for(lambda: (cluster.condition("DevicesAvailable") or ("",))[0] == "True", message="devices found")
    selectors = cluster.kube.field_selectors("resourceslices", GROUP)
    assert selectors and set(selectors) == {"spec.driver=xpu.kunlun.dev"}

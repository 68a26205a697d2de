"""The validating webhook of the running operator, called as the API server would call it."""

from __future__ import annotations

import copy
import json
import socket
import urllib.request
from typing import Any

import pytest

from tests.integration.operator.conftest import Cluster, wait_for

pytestmark = pytest.mark.slow
SPEC = {
    "model": {
        "name": "qwen",
        "source": {"hostPath": {"path": "/data/qwen"}},
        "parameters": "7B",
        "architecture": {"numLayers": 32, "numKVHeads": 32, "headDim": 128},
    },
    "runtime": {"maxModelLen": 8192},
    "versions": {"driver": "5.0.21.26", "firmware": "1.0.2.14.1.54", "kml": "3.2.0"},
    "resources": {"xpuProduct": "P800"},
}


def review(port: int, spec: dict[str, Any]) -> dict[str, Any]:
    body = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "review-1",
            "operation": "CREATE",
            "userInfo": {"username": "alice"},
            "kind": {"group": "serving.kunlun.dev", "version": "v1alpha1", "kind": "KunlunInferenceService"},
            "resource": {
                "group": "serving.kunlun.dev",
                "version": "v1alpha1",
                "resource": "kunluninferenceservices",
            },
            "object": {
                "apiVersion": "serving.kunlun.dev/v1alpha1",
                "kind": "KunlunInferenceService",
                "metadata": {"name": "qwen", "namespace": "ml"},
                "spec": spec,
            },
        },
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/validate-kis",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())["response"]


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def test_webhook_allows_denies_and_warns_naming_the_field(cluster: Cluster) -> None:
    port = cluster.start_operator().webhook_port
    wait_for(lambda: _accepts(port), message="the webhook server")
    allowed = review(port, copy.deepcopy(SPEC))
    assert allowed["allowed"] is True and "warnings" not in allowed

    unsupported = review(
        port,
        {
            **copy.deepcopy(SPEC),
            "versions": {"driver": "5.0.20", "firmware": "1.0.2.14.1.54", "kml": "3.2.0"},
        },
    )
    assert unsupported["allowed"] is False
    assert unsupported["status"] == {
        "code": 422,
        "message": "spec.versions.driver: driver 5.0.20 is not "
        "supported by runtime 0.1.0 (supported: 5.0.21.26)",
    }

    too_big = copy.deepcopy(SPEC)
    too_big["model"]["parameters"] = "70B"
    denied = review(port, too_big)
    assert denied["allowed"] is False
    assert denied["status"]["message"] == (
        "spec.resources.xpus: the model does not fit 1 × P800: weights 130.4 GiB + KV cache 4.0 GiB = "
        "134.4 GiB; available 86.4 GiB (90% of 1 × 96 GiB)"
    )

    warn = copy.deepcopy(too_big)
    warn["versions"]["policy"] = "Warn"
    warned = review(port, warn)
    assert warned["allowed"] is True
    assert warned["warnings"] == [denied["status"]["message"]]

    invalid = review(
        port, {**copy.deepcopy(SPEC), "resources": {"xpus": 3}, "runtime": {"tensorParallelSize": 2}}
    )
    assert invalid["allowed"] is False
    assert invalid["status"]["message"].startswith("spec.resources.xpus: 3 is not a multiple")


def test_webhook_rejects_what_the_admission_policy_forbids_naming_the_field(cluster: Cluster) -> None:
    port = cluster.start_operator().webhook_port  # policy: runtime images of ghcr.io/kunlun-inference/, /data
    wait_for(lambda: _accepts(port), message="the webhook server")
    host = copy.deepcopy(SPEC)
    host["model"]["source"] = {"hostPath": {"path": "/var/lib/kubelet"}}
    assert review(port, host)["status"] == {
        "code": 422,
        "message": "spec.model.source.hostPath.path: '/var/lib/kubelet' is not allowed by the admission "
        "policy (hostPaths: /data)",
    }
    image = {**copy.deepcopy(SPEC), "runtime": {"image": "docker.io/evil/kunlun-runtime:0.1.0"}}
    denied = review(port, image)
    assert denied["allowed"] is False
    assert denied["status"]["message"].startswith("spec.runtime.image: 'docker.io/evil/kunlun-runtime:0.1.0'")
    fetch = copy.deepcopy(SPEC)
    fetch["model"]["source"] = {"image": {"reference": "docker.io/evil/model:1"}}
    assert review(port, fetch)["status"]["message"].startswith("spec.model.source.image.reference:")
    flag = {**copy.deepcopy(SPEC), "runtime": {"extraArgs": ["--api-key", "s3cret"]}}
    assert review(port, flag)["status"]["message"].startswith("spec.runtime.extraArgs[0]:")


def test_a_service_admitted_before_the_policy_changed_is_not_deployed(cluster: Cluster) -> None:
    # The fake API has no webhook: creating the object directly plays "admitted under an older policy".
    cluster.add_node("xpu-1")
    cluster.start_operator()
    spec = copy.deepcopy(SPEC)
    spec["model"]["source"] = {"hostPath": {"path": "/etc"}}
    cluster.create_service(spec)
    wait_for(lambda: cluster.status().get("phase") == "Failed", message="phase Failed")
    assert cluster.condition("Ready") == (
        "False",
        "PolicyViolation",
        "spec.model.source.hostPath.path: '/etc' is not allowed by the admission policy (hostPaths: /data)",
    )
    assert cluster.deployment() is None

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

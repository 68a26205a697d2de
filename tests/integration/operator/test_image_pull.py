"""A runtime image that is not there is a status and an event (the real operator, fake API).

The test plays kubelet: it writes the runtime pod's container statuses, first waiting on a pull
failure of the image the operator put in the Deployment, then running it.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.integration.operator.conftest import NAMESPACE, RUNTIME_POD_LABELS, Cluster, wait_for

pytestmark = pytest.mark.slow
SPEC = {  # no spec.runtime.image: the compatibility matrix's image (the kunlun variant)
    "model": {"name": "qwen", "source": {"hostPath": {"path": "/data/qwen"}}},
    "versions": {"driver": "5.0.21.26", "firmware": "1.0.2.14.1.54", "kml": "3.2.0"},
}


def kubelet_reports(cluster: Cluster, name: str, init: dict[str, Any], main: dict[str, Any]) -> None:
    required = {"ready": False, "restartCount": 0}  # what the client's models insist on
    status = {
        "phase": "Pending",
        "initContainerStatuses": [{**required, **init}],
        "containerStatuses": [{**required, **main}],
    }
    cluster.core.patch_namespaced_pod_status(name, NAMESPACE, {"status": status})


def test_an_image_pull_back_off_is_a_condition_and_an_event_naming_the_image_cleared_once_pulled(
    cluster: Cluster,
) -> None:
    cluster.add_node("xpu-1")
    cluster.start_operator()
    cluster.create_service(copy.deepcopy(SPEC))
    image = wait_for(cluster.deployment, message="the Deployment")["spec"]["template"]["spec"]["containers"][
        0
    ]["image"]
    assert (
        image == "ghcr.io/kunlun-inference/kunlun-runtime:0.1.0-kunlun"
    )  # the matrix's, under the default's registry
    wait_for(lambda: cluster.condition("RuntimeImageAvailable"), message="the first status")
    assert cluster.condition("RuntimeImageAvailable")[:2] == ("Unknown", "NotPulledYet")

    pod = {
        "metadata": {"name": "qwen-a", "labels": RUNTIME_POD_LABELS},
        "spec": {"nodeName": "xpu-1", "containers": []},
    }
    cluster.core.create_namespaced_pod(NAMESPACE, pod)
    back_off = f'Back-off pulling image "{image}"'
    kubelet_reports(
        cluster,
        "qwen-a",
        {
            "name": "preflight",
            "image": image,
            "imageID": "",
            "state": {"waiting": {"reason": "ImagePullBackOff", "message": back_off}},
        },
        {
            "name": "runtime",
            "image": image,
            "imageID": "",
            "state": {"waiting": {"reason": "PodInitializing"}},
        },
    )
    _, reason, message = wait_for(
        lambda: (c := cluster.condition("RuntimeImageAvailable")) and c[0] == "False" and c,
        message="unavailable",
    )
    assert reason == "RuntimeImageUnavailable"
    assert message.startswith(
        f"cannot pull the runtime image {image}: pod qwen-a on node xpu-1 (ImagePullBackOff: "
    )
    assert (
        "make images KUNLUN_STACK=/path/to/kunlun-stack" in message
        and "docs/chart.md#container-images" in message
    )
    cluster.wait_for_events("RuntimeImageUnavailable")
    [event] = [e for e in cluster.kube.objects("events") if e.get("reason") == "RuntimeImageUnavailable"]
    assert (event["type"], event["involvedObject"]["name"], event["message"]) == ("Warning", "qwen", message)

    kubelet_reports(  # someone built and pushed it: kubelet pulls and runs it
        cluster,
        "qwen-a",
        {
            "name": "preflight",
            "image": image,
            "imageID": f"{image}@sha256:1",
            "state": {"terminated": {"exitCode": 0}},
        },
        {"name": "runtime", "image": image, "imageID": f"{image}@sha256:1", "state": {"running": {}}},
    )
    wait_for(lambda: (cluster.condition("RuntimeImageAvailable") or ("",))[0] == "True", message="cleared")
    assert cluster.condition("RuntimeImageAvailable") == (
        "True",
        "RuntimeImagePulled",
        f"runtime pods pulled {image}",
    )
    assert cluster.event_reasons().count("RuntimeImageUnavailable") == 1

"""A runtime image that cannot be pulled: read from the pods, reported as RuntimeImageAvailable."""

from __future__ import annotations

from typing import Any

from kunlun_operator.decide.image_pull import ImagePull, image_pull, runtime_image_condition
from kunlun_operator.decide.reconcile import PodFacts, reconcile
from kunlun_operator.shell.handlers import _pod_fingerprint
from kunlun_operator.spec.service import parse_spec_or_error
from tests.unit.operator.factories import NOW, make_facts, make_raw_spec, make_ref

MATRIX_IMAGE = "ghcr.io/kunlun-inference/kunlun-runtime:0.1.0-kunlun"  # the packaged matrix's entry
BACKOFF = f'Back-off pulling image "{MATRIX_IMAGE}"'
LATER = "2026-01-01T00:05:00Z"


def waiting(name: str, reason: str, image: str = MATRIX_IMAGE, message: str = BACKOFF) -> dict[str, Any]:
    return {
        "name": name,
        "image": image,
        "imageID": "",
        "state": {"waiting": {"reason": reason, "message": message}},
    }


def running(name: str, image: str = MATRIX_IMAGE) -> dict[str, Any]:
    return {"name": name, "image": image, "imageID": f"{image}@sha256:abc", "state": {"running": {}}}


def make_pod(
    *, init: list[dict[str, Any]] | None = None, main: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": "Pending"}
    if init is not None:
        status["initContainerStatuses"] = init
    if main is not None:
        status["containerStatuses"] = main
    return {"metadata": {"name": "qwen-1", "uid": "u1"}, "spec": {"nodeName": "xpu-1"}, "status": status}


def test_the_pull_state_of_the_runtime_image_is_read_from_runtime_and_preflight_only() -> None:
    assert image_pull(make_pod()) is None  # kubelet has not reported yet
    assert image_pull(make_pod(init=[waiting("preflight", "ImagePullBackOff")])) == ImagePull(
        "qwen-1", "xpu-1", MATRIX_IMAGE, "failing", "ImagePullBackOff", BACKOFF
    )
    failing = image_pull(make_pod(main=[waiting("runtime", "ErrImagePull", message="manifest unknown")]))
    assert failing is not None and (failing.state, failing.reason, failing.message) == (
        "failing",
        "ErrImagePull",
        "manifest unknown",
    )
    # the model image of an image source is not the runtime image
    assert image_pull(make_pod(init=[waiting("model-fetch", "ImagePullBackOff", image="models:q")])) is None
    assert image_pull(make_pod(main=[waiting("runtime", "ContainerCreating")])) is None
    pulled = image_pull(make_pod(init=[running("preflight")], main=[waiting("runtime", "PodInitializing")]))
    assert pulled == ImagePull("qwen-1", "xpu-1", MATRIX_IMAGE, "pulled")


def test_the_unbuilt_matrix_image_says_how_to_build_and_push_it() -> None:
    failing = ImagePull("qwen-1", "xpu-1", MATRIX_IMAGE, "failing", "ImagePullBackOff", BACKOFF)
    condition = runtime_image_condition([failing], MATRIX_IMAGE, from_matrix=True)
    assert (condition.type, condition.status, condition.reason) == (
        "RuntimeImageAvailable",
        "False",
        "RuntimeImageUnavailable",
    )
    assert condition.message == (
        f"cannot pull the runtime image {MATRIX_IMAGE}: pod qwen-1 on node xpu-1 (ImagePullBackOff: "
        f"{BACKOFF}). The service sets no spec.runtime.image, so it runs the compatibility matrix's image "
        f"{MATRIX_IMAGE}, the kunlun variant, which only a Kunlun vendor stack builds: build it with "
        "`make images KUNLUN_STACK=/path/to/kunlun-stack`, push it as that name (or set "
        "global.imageRegistry / spec.runtime.image to where it is), see docs/chart.md#container-images"
    )
    own = runtime_image_condition([failing], "registry.local/rt:1", from_matrix=False)
    assert "Check that spec.runtime.image" in own.message and "docs/chart.md#container-images" in own.message


def test_an_image_never_pulled_or_an_invalid_name_is_unavailable_too() -> None:
    never = f'Container image "{MATRIX_IMAGE}" is not present with pull policy of Never'
    absent = image_pull(make_pod(main=[waiting("runtime", "ErrImageNeverPull", message=never)]))
    assert absent == ImagePull("qwen-1", "xpu-1", MATRIX_IMAGE, "failing", "ErrImageNeverPull", never)
    condition = runtime_image_condition([absent], MATRIX_IMAGE, from_matrix=True)
    assert (condition.status, condition.reason) == ("False", "RuntimeImageUnavailable")
    assert condition.message.startswith(
        f"cannot pull the runtime image {MATRIX_IMAGE}: pod qwen-1 on node xpu-1 (ErrImageNeverPull: "
        f"{never}). With imagePullPolicy Never kubelet does not pull: load the image onto the node or "
        "allow pulls. The service sets no spec.runtime.image"
    )

    bad = "registry.local/RT:1"
    message = f'Failed to apply default image tag "{bad}": couldn\'t parse image name'
    invalid = image_pull(
        make_pod(init=[waiting("preflight", "InvalidImageName", image=bad, message=message)])
    )
    assert invalid == ImagePull("qwen-1", "xpu-1", bad, "failing", "InvalidImageName", message)
    condition = runtime_image_condition([invalid], bad, from_matrix=False)
    assert (condition.status, condition.reason, condition.message) == (
        "False",
        "RuntimeImageUnavailable",
        f"the runtime image name {bad} is invalid: pod qwen-1 on node xpu-1 (InvalidImageName: {message}). "
        "Set spec.runtime.image to a valid image reference (registry/name:tag)",
    )
    from_matrix = runtime_image_condition([invalid], bad, from_matrix=True)
    assert "Set the operator's --default-runtime-image" in from_matrix.message


def test_the_condition_clears_once_a_pod_pulls_and_is_unknown_before() -> None:
    pulled = ImagePull("qwen-1", "xpu-1", MATRIX_IMAGE, "pulled")
    assert runtime_image_condition([pulled], MATRIX_IMAGE, from_matrix=True).status == "True"
    unknown = runtime_image_condition([], MATRIX_IMAGE, from_matrix=True)
    assert (unknown.status, unknown.reason) == ("Unknown", "NotPulledYet")


def test_reconcile_posts_one_warning_naming_the_image_and_clears_when_pods_pull() -> None:
    backoff = PodFacts(
        "qwen-1", "xpu-1", pull=image_pull(make_pod(init=[waiting("preflight", "ImagePullBackOff")]))
    )
    first = reconcile(
        make_ref(), parse_spec_or_error(make_raw_spec()), None, make_facts(pods=(backoff,)), now=NOW
    )
    [cond] = [c for c in first.status["conditions"] if c["type"] == "RuntimeImageAvailable"]
    assert (cond["status"], cond["reason"]) == ("False", "RuntimeImageUnavailable")
    [event] = [e for e in first.events if e.reason == "RuntimeImageUnavailable"]
    assert (
        event.type == "Warning"
        and MATRIX_IMAGE in event.message
        and "make images KUNLUN_STACK=" in event.message
    )
    again = reconcile(
        make_ref(), parse_spec_or_error(make_raw_spec()), first.status, make_facts(pods=(backoff,)), now=LATER
    )
    assert [e for e in again.events if e.reason == "RuntimeImageUnavailable"] == []
    pulled = PodFacts("qwen-1", "xpu-1", pull=image_pull(make_pod(init=[running("preflight")])))
    cleared = reconcile(
        make_ref(), parse_spec_or_error(make_raw_spec()), again.status, make_facts(pods=(pulled,)), now=LATER
    )
    assert [
        (c["status"], c["reason"])
        for c in cleared.status["conditions"]
        if c["type"] == "RuntimeImageAvailable"
    ] == [("True", "RuntimeImagePulled")]


def test_the_pod_watch_wakes_the_service_when_the_pull_state_changes_not_on_each_back_off() -> None:
    backoff = make_pod(init=[waiting("preflight", "ImagePullBackOff")])
    err = make_pod(init=[waiting("preflight", "ErrImagePull", message="other")])
    assert _pod_fingerprint(backoff) == _pod_fingerprint(err)
    assert _pod_fingerprint(backoff) != _pod_fingerprint(make_pod(init=[running("preflight")]))
    assert _pod_fingerprint(backoff) != _pod_fingerprint(make_pod())

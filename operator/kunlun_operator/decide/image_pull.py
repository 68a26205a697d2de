"""Whether the runtime image can be pulled: read from the pods, reported as ``RuntimeImageAvailable``.

Owns: reading a runtime pod's pull state (the containers that run the runtime image: ``runtime``
and the ``preflight`` init container), and the service's ``RuntimeImageAvailable`` condition with a
message that names the image and how to build and push it. Must not talk to the API. Invariant:
the condition is False exactly while some runtime pod waits on a pull failure; it turns True once a
pod has the image, and is Unknown before any pod got that far.

Why: a service without ``spec.runtime.image`` runs the compatibility matrix's image, the ``kunlun``
variant that only a vendor Kunlun stack builds. On a cluster where nobody built and pushed it, the
pods sit in ImagePullBackOff (or ErrImageNeverPull, InvalidImageName); this makes that a status
and an event instead of a mystery.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kunlun_operator.decide.status import Condition

CONDITION_TYPE = "RuntimeImageAvailable"
REASON_UNAVAILABLE = "RuntimeImageUnavailable"
#: kubelet's waiting reasons of a container whose image is not there: it cannot be pulled, may not be
#: pulled (``imagePullPolicy: Never`` and not on the node), or its name is not an image reference.
INVALID_NAME = "InvalidImageName"
NEVER_PULL = "ErrImageNeverPull"
PULL_FAILURES = frozenset({"ImagePullBackOff", "ErrImagePull", NEVER_PULL, INVALID_NAME})
#: The containers the operator gives the runtime image (builders/pod_template.py, builders/preflight.py).
RUNTIME_CONTAINERS = frozenset({"runtime", "preflight"})
BUILD_DOC = "docs/chart.md#container-images"
MAX_KUBELET_MESSAGE = 300

PullState = Literal["failing", "pulled"]


@dataclass(frozen=True, slots=True)
class ImagePull:
    """What one runtime pod says about its runtime image."""

    pod: str
    node: str | None
    image: str  # the image kubelet pulls (the container's spec image)
    state: PullState
    reason: str = ""  # one of PULL_FAILURES (failing only)
    message: str = ""  # kubelet's message (failing only)

    def describe(self) -> str:
        detail = f"{self.reason}: {self.message}" if self.message else self.reason
        return f"pod {self.pod} on node {self.node or 'unknown'} ({detail})"


def image_pull(pod: Mapping[str, Any]) -> ImagePull | None:
    """The pull state of ``pod``'s runtime image; None while kubelet has not reported on it yet.

    A runtime container waiting on a pull failure makes it ``failing``; one with an image id
    (created, running or terminated) makes it ``pulled``.
    """
    status = pod.get("status") or {}
    meta = pod.get("metadata") or {}
    node = (pod.get("spec") or {}).get("nodeName")
    runtime = [
        c
        for c in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]
        if c.get("name") in RUNTIME_CONTAINERS
    ]
    for container in runtime:
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in PULL_FAILURES:
            message = str(waiting.get("message") or "")[:MAX_KUBELET_MESSAGE]
            image = str(container.get("image") or "")
            return ImagePull(str(meta.get("name")), node, image, "failing", waiting["reason"], message)
    for container in runtime:
        if container.get("imageID"):
            return ImagePull(str(meta.get("name")), node, str(container.get("image") or ""), "pulled")
    return None


def how_to_fix(image: str, *, from_matrix: bool) -> str:
    """What to do about an image that cannot be pulled (``from_matrix``: the service names none)."""
    if from_matrix:
        return (
            f"The service sets no spec.runtime.image, so it runs the compatibility matrix's image {image}, "
            "the kunlun variant, which only a Kunlun vendor stack builds: build it with "
            "`make images KUNLUN_STACK=/path/to/kunlun-stack`, push it as that name (or set "
            f"global.imageRegistry / spec.runtime.image to where it is), see {BUILD_DOC}"
        )
    return (
        f"Check that spec.runtime.image {image} exists in its registry and that the nodes may pull it "
        f"(imagePullSecrets); build the runtime image with `make images` (`KUNLUN_STACK=…` for the "
        f"kunlun variant) and push it, see {BUILD_DOC}"
    )


def _unavailable(failing: list[ImagePull], image: str, from_matrix: bool) -> str:
    """The message of ``RuntimeImageAvailable=False``: what kubelet said, and what to do."""
    invalid = [p for p in failing if p.reason == INVALID_NAME]
    if invalid:  # no registry can help: the reference itself is wrong
        refs = sorted({p.image or image for p in invalid})
        where = (
            "the operator's --default-runtime-image, the compatibility matrix's image or the chart's "
            "global.imageRegistry (the service sets no spec.runtime.image)"
            if from_matrix
            else "spec.runtime.image"
        )
        return (
            f"the runtime image name {', '.join(refs)} is invalid: "
            f"{'; '.join(p.describe() for p in invalid)}. Set {where} to a valid image reference "
            "(registry/name:tag)"
        )
    images = sorted({p.image or image for p in failing})
    listed = "; ".join(p.describe() for p in failing)
    never = (
        " With imagePullPolicy Never kubelet does not pull: load the image onto the node or allow pulls."
        if any(p.reason == NEVER_PULL for p in failing)
        else ""
    )
    return f"cannot pull the runtime image {', '.join(images)}: {listed}.{never} " + how_to_fix(
        images[0], from_matrix=from_matrix
    )


def runtime_image_condition(pulls: Iterable[ImagePull], image: str, *, from_matrix: bool) -> Condition:
    """``RuntimeImageAvailable`` for the service's pods' pull states and the image it plans."""
    pulls = tuple(pulls)
    failing = sorted((p for p in pulls if p.state == "failing"), key=lambda p: p.pod)
    if failing:
        return Condition(
            CONDITION_TYPE, "False", REASON_UNAVAILABLE, _unavailable(failing, image, from_matrix)
        )
    pulled = sorted({p.image or image for p in pulls if p.state == "pulled"})
    if pulled:
        return Condition(
            CONDITION_TYPE, "True", "RuntimeImagePulled", f"runtime pods pulled {', '.join(pulled)}"
        )
    return Condition(CONDITION_TYPE, "Unknown", "NotPulledYet", f"no runtime pod has pulled {image} yet")

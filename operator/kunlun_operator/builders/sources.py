"""Volumes of weights: the model's source and each LoRA adapter's, and the init container that
copies an image source into its volume where image volumes are not used.

Owns: how a ``ModelSource`` (pvc, hostPath, OCI image) becomes a pod volume, and the fetch init
container, for the model and the adapters alike (one code for both). Pure; the callers name the
volume. Invariant: a source's volume is read-only to the runtime (a PVC is mounted ``readOnly``,
a host path must be a directory, an image is read as it is).
"""

from __future__ import annotations

from typing import Any

from kunlun_operator.builders.common import RESTRICTED_CONTAINER
from kunlun_operator.spec.values import ModelSource

#: An image source without image volumes: a fetch init container copies the image's
#: IMAGE_MODEL_DIR into the volume, mounted in it at FETCH_TARGET.
IMAGE_MODEL_DIR = "/models"
FETCH_TARGET = "/model-fetch"


def source_volume(name: str, source: ModelSource, *, image_volumes: bool) -> dict[str, Any]:
    """The volume ``name`` holding ``source`` (an ``emptyDir`` filled by ``fetch_container`` for an
    image source without image volumes)."""
    if source.kind == "pvc":
        return {"name": name, "persistentVolumeClaim": {"claimName": source.claim_name, "readOnly": True}}
    if source.kind == "hostPath":
        return {"name": name, "hostPath": {"path": source.path, "type": "Directory"}}
    if image_volumes:
        return {"name": name, "image": {"reference": source.reference, "pullPolicy": source.pull_policy}}
    return {"name": name, "emptyDir": {}}


def fetch_container(name: str, source: ModelSource, volume: str) -> dict[str, Any]:
    """The init container ``name`` copying the image ``source``'s IMAGE_MODEL_DIR into ``volume``."""
    return {
        "name": name,
        "image": source.reference,
        "imagePullPolicy": source.pull_policy,
        # -R, not -a: the emptyDir is root's, so keeping its times is refused to our user;
        # symlinks are copied as links (a snapshot of blobs stays one).
        "command": ["sh", "-c", f"cp -R {IMAGE_MODEL_DIR}/. {FETCH_TARGET}/"],
        "securityContext": dict(RESTRICTED_CONTAINER),
        # Not at the image's own /models: a mount there would hide what is to be copied.
        "volumeMounts": [{"name": volume, "mountPath": FETCH_TARGET}],
    }

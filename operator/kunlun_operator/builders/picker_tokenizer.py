"""The tokenizer sidecar of a precise Endpoint Picker: llm-d's picker tokenises prompts through it.

Owns: the ``tokenizer`` container (llm-d-kv-cache's UDS tokenizer service) beside the picker, the
``tokenizer-socket`` emptyDir both share at ``/tmp/tokenizer`` (the picker dials the gRPC socket
``SOCKET_FILE`` there), the directory holding the model's tokenizer files inside the sidecar and,
for an image model source without image volumes, the init container copying those files out of
the image. llm-d's release build (``CGO_ENABLED=0``) carries no tokenizer of its own: without this
sidecar its precise scorer cannot start. Invariant: nothing is downloaded: the sidecar runs with
the Hugging Face libraries offline and reads ``tokenizer.json`` (the vocabulary) and
``tokenizer_config.json`` (the chat template) from the model's own files.
"""

from __future__ import annotations

from typing import Any

from kunlun_operator import names
from kunlun_operator.builders.common import RESTRICTED_CONTAINER
from kunlun_operator.builders.pod_template import MODEL_IMAGE_MOUNT, MODEL_VOLUME, model_path
from kunlun_operator.spec.values import InferenceSpec

SOCKET_VOLUME = "tokenizer-socket"
SOCKET_DIR = "/tmp/tokenizer"  # where the sidecar listens (fixed in its image) and the picker dials
SOCKET_FILE = f"{SOCKET_DIR}/tokenizer-uds.socket"
#: The files the sidecar loads: the vocabulary and the tokenizer's configuration with its chat template.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TOKENIZER_MOUNT = "/tokenizer"  # an image source without image volumes: the files copied here
HEALTH_PORT = 8082
SCRATCH = "/tmp"  # the sidecar's writable scratch (its root filesystem is read-only)
DEFAULT_RESOURCES = {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}}
#: No download, ever: the Hugging Face libraries offline, their cache in the scratch directory.
OFFLINE_ENV = (
    ("HF_HUB_OFFLINE", "1"),
    ("TRANSFORMERS_OFFLINE", "1"),
    ("HF_HOME", f"{SCRATCH}/hf"),
    ("USE_MODELSCOPE", "false"),
    ("LOG_LEVEL", "INFO"),
    ("PROBE_PORT", str(HEALTH_PORT)),
)


def tokenizer_dir(spec: InferenceSpec, *, image_volumes: bool) -> str:
    """The directory of the model's tokenizer files inside the sidecar: the model source, mounted as
    the runtime mounts it, or the copy of an image source without image volumes. The picker's
    indexer names it for the model (``modelTokenizerMap``) and the sidecar loads it from there."""
    if spec.model.source.kind == "image" and not image_volumes:
        return TOKENIZER_MOUNT
    return model_path(spec, image_volumes=image_volumes)


def _model_mount(spec: InferenceSpec, *, image_volumes: bool) -> dict[str, Any]:
    if spec.model.source.kind == "image":
        path = MODEL_IMAGE_MOUNT if image_volumes else TOKENIZER_MOUNT
        return {"name": MODEL_VOLUME, "mountPath": path, "readOnly": True}
    return {"name": MODEL_VOLUME, "mountPath": names.MODEL_MOUNT_PATH, "readOnly": True}


def socket_mount() -> dict[str, Any]:
    """The shared socket directory, mounted the same in the picker and the sidecar."""
    return {"name": SOCKET_VOLUME, "mountPath": SOCKET_DIR}


def _http_probe(period: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": "/healthz", "port": HEALTH_PORT},
        "periodSeconds": period,
        "failureThreshold": 3,
    }


def build_tokenizer_container(spec: InferenceSpec, image: str, *, image_volumes: bool) -> dict[str, Any]:
    """The sidecar serving the picker's tokenizer over ``SOCKET_FILE``, healthy on ``/healthz``
    once its socket listens."""
    return {
        "name": "tokenizer",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "env": [{"name": name, "value": value} for name, value in OFFLINE_ENV],
        "ports": [{"name": "tokenizer-health", "containerPort": HEALTH_PORT, "protocol": "TCP"}],
        "resources": dict(DEFAULT_RESOURCES),
        "readinessProbe": _http_probe(5),
        "livenessProbe": _http_probe(10),
        "securityContext": dict(RESTRICTED_CONTAINER),
        "volumeMounts": [
            {"name": "tmp", "mountPath": SCRATCH},
            socket_mount(),
            _model_mount(spec, image_volumes=image_volumes),
        ],
    }


def build_tokenizer_fetch(spec: InferenceSpec) -> dict[str, Any]:
    """Copies only the tokenizer files out of an image model source (the picker needs no weights)."""
    source = spec.model.source
    files = [f"{names.MODEL_MOUNT_PATH}/{name}" for name in TOKENIZER_FILES]
    return {
        "name": "tokenizer-fetch",
        "image": source.reference,
        "imagePullPolicy": source.pull_policy,
        "command": ["cp", *files, f"{TOKENIZER_MOUNT}/"],
        "securityContext": dict(RESTRICTED_CONTAINER),
        "volumeMounts": [{"name": MODEL_VOLUME, "mountPath": TOKENIZER_MOUNT}],
    }

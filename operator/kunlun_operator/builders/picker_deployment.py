"""The Endpoint Picker's Deployment: the ext-proc server a Gateway asks which pod serves a request.

Owns: the ``<name>-epp`` Deployment of a routed service. Its flags are the Gateway API Inference
Extension's picker's (llm-d's takes the same): the pool it serves (``--pool-name``, namespace and
group), its ports (ext-proc 9002, gRPC health 9003, metrics 9090) and its plugin configuration
(``picker_config``, mounted from the ConfigMap, whose hash rolls the picker). Its metrics endpoint
runs without authentication: checking tokens needs a ClusterRole (TokenReviews), which the operator
does not create. A precise picker (llm-d's) tokenises through its sidecar (``picker_tokenizer``),
which reads the model's tokenizer files from the model source, over a socket in a shared emptyDir.
Invariant: its pods carry the picker's labels, never the runtime's, so no runtime selector matches
them; they run under the restricted Pod Security profile with the ServiceAccount ``picker_rbac``
binds.
"""

from __future__ import annotations

from typing import Any

from kunlun_operator import names
from kunlun_operator.builders.common import PICKER_LABELS, RESTRICTED_CONTAINER, build_metadata, header
from kunlun_operator.builders.picker_tokenizer import (
    SOCKET_VOLUME,
    build_tokenizer_container,
    build_tokenizer_fetch,
    socket_mount,
)
from kunlun_operator.builders.pod_template import TERMINATION_GRACE_SECONDS, model_volume
from kunlun_operator.spec.service import ServiceRef
from kunlun_operator.spec.values import InferenceSpec

CONFIG_MOUNT = "/config"
CONFIG_FILE = f"{CONFIG_MOUNT}/config.yaml"
#: The picker images run as this non-root user (distroless ``nonroot``).
PICKER_USER = 65532
DEFAULT_RESOURCES = {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}}
#: The gRPC health service both pickers answer for (without leader election every name is served).
HEALTH_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


def picker_args(ref: ServiceRef) -> list[str]:
    """The picker's command line: the pool it serves, its ports and its configuration file."""
    return [
        "--pool-name",
        names.owned_name(ref.name, names.INFERENCE_POOL),
        "--pool-namespace",
        ref.namespace,
        "--pool-group",
        names.INFERENCE_GROUP_VERSION.partition("/")[0],
        "--grpc-port",
        str(names.PICKER_EXT_PROC_PORT),
        "--grpc-health-port",
        str(names.PICKER_HEALTH_PORT),
        "--metrics-port",
        str(names.PICKER_METRICS_PORT),
        "--config-file",
        CONFIG_FILE,
        "--zap-encoder",
        "json",
        "--metrics-endpoint-auth=false",
        "--tracing=false",
    ]


def _grpc_probe(period: int) -> dict[str, Any]:
    return {
        "grpc": {"port": names.PICKER_HEALTH_PORT, "service": HEALTH_SERVICE},
        "periodSeconds": period,
        "failureThreshold": 3,
    }


def _container(ref: ServiceRef, spec: InferenceSpec, image: str) -> dict[str, Any]:
    return {
        "name": "epp",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "args": picker_args(ref),
        "ports": [
            {"name": "grpc", "containerPort": names.PICKER_EXT_PROC_PORT, "protocol": "TCP"},
            {"name": "grpc-health", "containerPort": names.PICKER_HEALTH_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": names.PICKER_METRICS_PORT, "protocol": "TCP"},
        ],
        "env": [
            {"name": "NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        ],
        "resources": dict(spec.routing.picker.resources or DEFAULT_RESOURCES),
        "readinessProbe": _grpc_probe(5),
        "livenessProbe": _grpc_probe(10),
        "securityContext": dict(RESTRICTED_CONTAINER),
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }


def build_picker_pod_spec(
    ref: ServiceRef, spec: InferenceSpec, image: str, *, tokenizer_image: str, image_volumes: bool
) -> dict[str, Any]:
    """The picker's pod; a precise one has the tokenizer sidecar running ``tokenizer_image``, which
    mounts the model's source (a hostPath source exists on the Kunlun nodes only, so such a picker
    runs there)."""
    container = _container(ref, spec, image)
    pod: dict[str, Any] = {
        "serviceAccountName": names.owned_name(ref.name, names.PICKER_SERVICE_ACCOUNT),
        "automountServiceAccountToken": True,  # it watches its pool and the pool's pods
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": PICKER_USER,
            "runAsGroup": PICKER_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        # as long as the pool's pods drain: requests in flight keep their stream through the gateway
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
    }
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": names.owned_name(ref.name, names.PICKER_CONFIGMAP)}},
        {"name": "tmp", "emptyDir": {}},
    ]
    containers = [container]
    if spec.routing.precise:
        source = spec.model.source
        container["volumeMounts"].append(socket_mount())
        containers.append(build_tokenizer_container(spec, tokenizer_image, image_volumes=image_volumes))
        volumes += [{"name": SOCKET_VOLUME, "emptyDir": {}}, model_volume(spec, image_volumes=image_volumes)]
        if source.kind == "image" and not image_volumes:
            pod["initContainers"] = [build_tokenizer_fetch(spec)]
        if source.kind == "hostPath":
            pod["nodeSelector"] = {names.LABEL_PRESENT: "true"}
            pod["tolerations"] = [{"key": names.RESOURCE_NAME, "operator": "Exists", "effect": "NoSchedule"}]
    pod["containers"] = containers
    pod["volumes"] = volumes
    return pod


def build_picker_deployment(
    ref: ServiceRef,
    spec: InferenceSpec,
    *,
    image: str,
    tokenizer_image: str,
    config_hash: str,
    image_volumes: bool,
) -> dict[str, Any]:
    """The picker's Deployment running ``image`` (a precise one with its tokenizer sidecar running
    ``tokenizer_image``); ``config_hash``: of its ConfigMap's data."""
    selector = names.picker_selector_labels(ref.name)
    return {
        **header(names.PICKER_DEPLOYMENT),
        "metadata": build_metadata(ref, names.PICKER_DEPLOYMENT, labels=PICKER_LABELS),
        "spec": {
            "replicas": spec.routing.picker.replicas,
            "selector": {"matchLabels": selector},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {
                    "labels": {**names.common_labels(ref.name), **PICKER_LABELS},
                    "annotations": {names.ANNOTATION_CONFIG_HASH: config_hash},
                },
                "spec": build_picker_pod_spec(
                    ref, spec, image, tokenizer_image=tokenizer_image, image_volumes=image_volumes
                ),
            },
        },
    }

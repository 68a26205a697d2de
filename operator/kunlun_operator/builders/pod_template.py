"""The runtime pod template, shared by the Deployment and the LeaderWorkerSet.

Owns: the pod (``build_pod_spec``) and its template (``build_pod_template``: the pod with the
common labels and the config hash annotation, so a changed ConfigMap rolls the pods). Under
``Strict`` the pods require nodes whose labels carry the locked driver/firmware/KML versions, and
the preflight init container (``preflight``) re-checks them on the node before the model loads. The
startup probe's budget grows with the model's size so a loading model is never killed; readiness
and liveness start after it. A readiness gate on the node agent's ``kunlun.dev/xpu-healthy``
condition takes a pod on a failed card out of the Service before any request fails. With a claim
template (``spec.resources.allocation: dra``) the pod and its preflight claim the cards through it
(``resource_claim``) instead: no extended resource, no node selector or affinity on the
labeler's labels, whose place the claim's CEL selectors take, and no readiness gate (no node
agent sets it on a dra node; the claim's health comes as ``allocatedResourcesStatus``). Invariant: the
workloads differ only in what wraps this template (and, for LeaderWorkerSet roles, the runtime
container's ports, probes and stop), so a single-node and a multi-node pod are locked alike.
"""

from __future__ import annotations

import copy
import math
from typing import Any, NotRequired, TypedDict, Unpack

from kunlun_operator import names
from kunlun_operator.builders.adapters import (
    adapter_fetch_containers,
    adapter_volume_mounts,
    adapter_volumes,
    runtime_command,
)
from kunlun_operator.builders.common import RESTRICTED_CONTAINER
from kunlun_operator.builders.configmap import runtime_args
from kunlun_operator.builders.kv_events import KV_EVENTS_CONTAINER_PORT, kv_events_env
from kunlun_operator.builders.preflight import build_preflight_container, build_preflight_volumes
from kunlun_operator.builders.resource_claim import CONTAINER_CLAIMS, pod_resource_claims
from kunlun_operator.builders.sources import fetch_container, source_volume
from kunlun_operator.policy.feasibility import startup_budget_seconds
from kunlun_operator.spec.operator_config import DEFAULT_PREFLIGHT_HOST, PreflightHost
from kunlun_operator.spec.service import ServiceRef
from kunlun_operator.spec.values import InferenceSpec, SecretKeyRef

RUN_AS_USER = 1000
STARTUP_PERIOD_SECONDS = 10
DRAIN_SECONDS = 15  # preStop: let endpoints drop the pod before the runtime gets SIGTERM
TERMINATION_GRACE_SECONDS = 90  # drain + finishing in-flight generations
MODEL_VOLUME = "model"
MODEL_IMAGE_MOUNT = "/model-image"  # image volumes: the image's root; the model is under models/
#: The runtime reads its API key and metrics token from these (``--api-key``, ``--metrics-token``
#: default to them), so the secrets never appear in the ConfigMap, the pod's args or ``ps``.
API_KEY_ENV = "VLLM_API_KEY"
METRICS_TOKEN_ENV = "KUNLUN_METRICS_TOKEN"


class PodArgs(TypedDict):
    """What shapes the runtime pod besides the spec: ``build_pod_spec``'s keyword arguments."""

    image: str  # the runtime image
    image_volumes: bool  # --image-volumes: image model sources as image volumes
    xpu_health_gate: NotRequired[bool]  # --[no-]xpu-health-gate (default on)
    preflight_host: NotRequired[PreflightHost]  # --preflight-*: the node files the preflight mounts
    #: The ResourceClaimTemplate the pod claims its cards through (allocation dra); None: the
    #: device plugin's extended resource.
    claim_template: NotRequired[str | None]


class TemplateArgs(PodArgs):
    """``build_pod_template``'s keyword arguments, which the workload builders pass on."""

    config_hash: str  # of the ConfigMap's data: a new value rolls the pods


def model_path(spec: InferenceSpec, *, image_volumes: bool) -> str:
    """Where the runtime finds the model inside its container."""
    source = spec.model.source
    if source.kind == "pvc" and source.path:
        return f"{names.MODEL_MOUNT_PATH}/{source.path.strip('/')}"
    if source.kind == "image" and image_volumes:
        return f"{MODEL_IMAGE_MOUNT}/models"
    return names.MODEL_MOUNT_PATH


def version_lock_terms(spec: InferenceSpec) -> list[dict[str, Any]]:
    """Node-selector requirements on the labeler's version labels (Strict only).

    Raises:
        SpecError: a version is unset (only possible under policy Off).
    """
    driver, firmware, kml = spec.versions.locked_versions()
    return [
        {"key": names.LABEL_DRIVER_VERSION, "operator": "In", "values": [driver]},
        {"key": names.LABEL_FIRMWARE_VERSION, "operator": "In", "values": [firmware]},
        {"key": names.LABEL_KML_VERSION, "operator": "In", "values": [kml]},
    ]


def build_affinity(spec: InferenceSpec, *, claimed: bool = False) -> dict[str, Any] | None:
    """The user's affinity with the version lock ANDed into every required node-selector term
    (not for ``claimed`` cards: the claim's selectors lock the versions)."""
    affinity = copy.deepcopy(dict(spec.scheduling.affinity or {}))
    if spec.versions.policy != "Strict" or claimed:
        return affinity or None
    lock = version_lock_terms(spec)
    required = affinity.setdefault("nodeAffinity", {}).setdefault(
        "requiredDuringSchedulingIgnoredDuringExecution", {}
    )
    terms = required.get("nodeSelectorTerms") or [{}]
    required["nodeSelectorTerms"] = [
        {**term, "matchExpressions": [*term.get("matchExpressions", []), *lock]} for term in terms
    ]
    return affinity


def _resources(spec: InferenceSpec, *, claimed: bool) -> dict[str, Any]:
    xpus = str(spec.resources.xpus)
    requests: dict[str, str] = {} if claimed else {names.RESOURCE_NAME: xpus}
    limits: dict[str, str] = {} if claimed else {names.RESOURCE_NAME: xpus}
    if spec.resources.cpu is not None:
        requests["cpu"] = spec.resources.cpu
    if spec.resources.memory is not None:
        requests["memory"] = limits["memory"] = spec.resources.memory
    resources: dict[str, Any] = {"requests": requests, "limits": limits}
    if claimed:
        resources = {k: v for k, v in resources.items() if v}
        resources["claims"] = [dict(c) for c in CONTAINER_CLAIMS]
    return resources


def _probe(period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": names.HEALTH_PATH, "port": names.RUNTIME_PORT_NAME},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def secret_env(name: str, ref: SecretKeyRef) -> dict[str, Any]:
    """An env var read from one key of a Secret (the pod does not start while it is missing)."""
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}


def _secret_env(spec: InferenceSpec) -> list[dict[str, Any]]:
    env = []
    if spec.api_key_secret is not None:
        env.append(secret_env(API_KEY_ENV, spec.api_key_secret))
    if spec.metrics_token_secret is not None:
        env.append(secret_env(METRICS_TOKEN_ENV, spec.metrics_token_secret))
    return env


def _runtime_container(
    ref: ServiceRef, spec: InferenceSpec, image: str, path: str, *, claimed: bool, image_volumes: bool
) -> dict[str, Any]:
    mounts = [
        {
            "name": MODEL_VOLUME,
            "mountPath": MODEL_IMAGE_MOUNT if path.startswith(MODEL_IMAGE_MOUNT) else names.MODEL_MOUNT_PATH,
            "readOnly": True,
        },
        {"name": "config", "mountPath": names.CONFIG_MOUNT_PATH, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "shm", "mountPath": "/dev/shm"},
        *adapter_volume_mounts(spec),
    ]
    env = [
        {"name": "HOME", "value": "/tmp"},
        *_secret_env(spec),
        *kv_events_env(ref, spec),
        *(dict(e) for e in spec.runtime.env),
    ]
    ports = [{"name": names.RUNTIME_PORT_NAME, "containerPort": names.RUNTIME_PORT, "protocol": "TCP"}]
    if spec.routing.precise:
        ports.append(dict(KV_EVENTS_CONTAINER_PORT))
    return {
        "name": "runtime",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": runtime_command(spec),
        "args": runtime_args(spec, path, image_volumes=image_volumes),
        "ports": ports,
        "env": env,
        "resources": _resources(spec, claimed=claimed),
        "startupProbe": _probe(
            STARTUP_PERIOD_SECONDS, math.ceil(startup_budget_seconds(spec) / STARTUP_PERIOD_SECONDS)
        ),
        "readinessProbe": _probe(5, 3),
        "livenessProbe": _probe(15, 4),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(DRAIN_SECONDS)]}}},
        "securityContext": dict(RESTRICTED_CONTAINER),
        "volumeMounts": mounts,
    }


def _init_containers(
    spec: InferenceSpec, image: str, host: PreflightHost, *, image_volumes: bool, claimed: bool
) -> list[dict[str, Any]]:
    inits: list[dict[str, Any]] = []
    source = spec.model.source
    if source.kind == "image" and not image_volumes:
        inits.append(fetch_container("model-fetch", source, MODEL_VOLUME))
    inits += adapter_fetch_containers(spec, image_volumes=image_volumes)
    if spec.versions.policy == "Strict":
        inits.append(build_preflight_container(spec, image, host, claimed=claimed))
    return inits


def model_volume(spec: InferenceSpec, *, image_volumes: bool) -> dict[str, Any]:
    """The volume ``model`` holding the model source (an ``emptyDir`` filled by ``model-fetch`` for
    an image source without image volumes)."""
    return source_volume(MODEL_VOLUME, spec.model.source, image_volumes=image_volumes)


def build_pod_spec(
    ref: ServiceRef,
    spec: InferenceSpec,
    image: str,
    *,
    image_volumes: bool,
    xpu_health_gate: bool = True,
    preflight_host: PreflightHost = DEFAULT_PREFLIGHT_HOST,
    claim_template: str | None = None,
) -> dict[str, Any]:
    """The runtime pod; ``xpu_health_gate``: the readiness gate on the node agent's condition (off
    only where no node agent sets it: a gate nobody sets keeps the pod NotReady forever; never on
    a pod with a ``claim_template``);
    ``preflight_host``: the node's files the Strict preflight mounts; ``claim_template``: the
    ResourceClaimTemplate its cards come from (None: the extended resource)."""
    path = model_path(spec, image_volumes=image_volumes)
    claimed = claim_template is not None
    node_selector = dict(spec.scheduling.node_selector)
    if not claimed:
        node_selector = {names.LABEL_PRESENT: "true", **node_selector}
        if spec.resources.xpu_product:
            node_selector[names.LABEL_PRODUCT] = spec.resources.xpu_product
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
        **({"nodeSelector": node_selector} if node_selector else {}),
        "tolerations": [
            {"key": names.RESOURCE_NAME, "operator": "Exists", "effect": "NoSchedule"},
            *(dict(t) for t in spec.scheduling.tolerations),
        ],
    }
    if xpu_health_gate and not claimed:
        # The node agent sets this condition on every pod holding a card (False while a card is
        # unhealthy): a pod on a failed card leaves the Service's endpoints at once. Nothing sets
        # it on a dra node: a claimed card's health comes as allocatedResourcesStatus instead.
        pod["readinessGates"] = [{"conditionType": names.XPU_HEALTHY_CONDITION}]
    affinity = build_affinity(spec, claimed=claimed)
    if affinity:
        pod["affinity"] = affinity
    if spec.scheduling.priority_class_name:
        pod["priorityClassName"] = spec.scheduling.priority_class_name
    if claim_template is not None:
        pod["resourceClaims"] = pod_resource_claims(claim_template)
    inits = _init_containers(spec, image, preflight_host, image_volumes=image_volumes, claimed=claimed)
    if inits:
        pod["initContainers"] = inits
    pod["containers"] = [
        _runtime_container(ref, spec, image, path, claimed=claimed, image_volumes=image_volumes)
    ]
    pod["volumes"] = [
        model_volume(spec, image_volumes=image_volumes),
        {"name": "config", "configMap": {"name": names.owned_name(ref.name, names.CONFIGMAP)}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "shm", "emptyDir": {"medium": "Memory"}},
        *adapter_volumes(spec, image_volumes=image_volumes),
    ]
    if spec.versions.policy == "Strict":
        pod["volumes"] += build_preflight_volumes(preflight_host)
    return pod


def build_pod_template(
    ref: ServiceRef, spec: InferenceSpec, *, config_hash: str, **pod: Unpack[PodArgs]
) -> dict[str, Any]:
    """The runtime pod (``build_pod_spec``) as a workload's template: the common labels, which the
    workload's selector matches, and the config hash annotation."""
    return {
        "metadata": {
            "labels": names.common_labels(ref.name),
            "annotations": {names.ANNOTATION_CONFIG_HASH: config_hash},
        },
        "spec": build_pod_spec(ref, spec, **pod),
    }

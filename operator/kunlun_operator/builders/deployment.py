"""The Deployment of the runtime: version lock, device requests, probes, draining, rollout.

Owns: the pod template. Under ``Strict`` the pods require nodes whose labels carry the locked
driver/firmware/KML versions, and an init container re-checks them on the node with
``kunlun-runtime preflight`` before the model loads. That container requests the same number of
cards as the runtime, so kubelet hands it the same device nodes (``/dev/xpuN``, ``/dev/xpuctrl``)
and ``XPU_VISIBLE_DEVICES`` from the device plugin's ``Allocate``; it mounts the directory of the
node's KML version file (so a node without the file reaches preflight, whose error names it, instead
of stopping at kubelet's mount) and, when configured, the node's ``xpu-smi`` (read-only ``hostPath``
volumes) and passes their paths as flags (``PreflightHost``). The startup probe's budget grows with the
model's size so a loading model is never killed; readiness and liveness start after it. A
readiness gate on the node agent's ``kunlun.dev/xpu-healthy`` condition takes a pod on a failed
card out of the Service before any request fails.
"""

from __future__ import annotations

import copy
import math
import posixpath
from dataclasses import dataclass
from typing import Any

from kunlun_operator import names
from kunlun_operator.builders.common import build_metadata, header
from kunlun_operator.builders.configmap import runtime_args
from kunlun_operator.policy.feasibility import startup_budget_seconds
from kunlun_operator.spec.service import InferenceSpec, SecretKeyRef, ServiceRef

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
#: Where the preflight container sees the node's files (hostPath mounts, read-only): the KML version
#: file's directory at its host path under this root (so preflight's error shows the host path),
#: ``xpu-smi`` at a fixed path.
PREFLIGHT_HOST_ROOT = "/run/kunlun-host"
PREFLIGHT_XPU_SMI_PATH = "/run/kunlun-host/bin/xpu-smi"
PREFLIGHT_KML_VOLUME = "host-kml-version"
PREFLIGHT_XPU_SMI_VOLUME = "host-xpu-smi"
RESTRICTED_CONTAINER = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "readOnlyRootFilesystem": True,
}


@dataclass(frozen=True, slots=True)
class PreflightHost:
    """The node's files the preflight init container mounts (operator flags ``--preflight-*``)."""

    #: Host path of the KML version file; its directory is mounted (``hostPath`` without a type
    #: check), so a node without the file starts the preflight, which fails naming the file;
    #: None: no hostPath at all, preflight reads the image's own KML version file (namespaces
    #: enforcing the Pod Security "baseline" or "restricted" level refuse every hostPath volume).
    kml_version_file: str | None = names.HOST_KML_VERSION_FILE
    #: Host path of the node agent's ``xpu-smi`` (``hostPath`` of type File); None: the image's own
    #: (``xpu-smi`` on its PATH, or ``$KUNLUN_XPU_SMI``).
    xpu_smi: str | None = None


#: The operator's defaults: the labeler's KML version file, the image's own xpu-smi.
DEFAULT_PREFLIGHT_HOST = PreflightHost()


def preflight_kml_mount(host_file: str) -> tuple[str, str]:
    """``(host directory, its mount path)`` of the KML version file ``host_file``: the directory
    at its own path under ``PREFLIGHT_HOST_ROOT``. The file is then at ``mount path/basename``."""
    directory = posixpath.dirname(host_file.rstrip("/"))
    return directory, PREFLIGHT_HOST_ROOT + directory


def preflight_kml_path(host_file: str) -> str:
    """Where the preflight container reads the node's KML version file ``host_file``."""
    return PREFLIGHT_HOST_ROOT + host_file.rstrip("/")


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


def build_affinity(spec: InferenceSpec) -> dict[str, Any] | None:
    """The user's affinity with the version lock ANDed into every required node-selector term."""
    affinity = copy.deepcopy(dict(spec.scheduling.affinity or {}))
    if spec.versions.policy != "Strict":
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


def _resources(spec: InferenceSpec) -> dict[str, Any]:
    xpus = str(spec.resources.xpus)
    requests: dict[str, str] = {names.RESOURCE_NAME: xpus}
    limits: dict[str, str] = {names.RESOURCE_NAME: xpus}
    if spec.resources.cpu is not None:
        requests["cpu"] = spec.resources.cpu
    if spec.resources.memory is not None:
        requests["memory"] = limits["memory"] = spec.resources.memory
    return {"requests": requests, "limits": limits}


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


def _runtime_container(spec: InferenceSpec, image: str, path: str) -> dict[str, Any]:
    mounts = [
        {
            "name": MODEL_VOLUME,
            "mountPath": MODEL_IMAGE_MOUNT if path.startswith(MODEL_IMAGE_MOUNT) else names.MODEL_MOUNT_PATH,
            "readOnly": True,
        },
        {"name": "config", "mountPath": names.CONFIG_MOUNT_PATH, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "shm", "mountPath": "/dev/shm"},
    ]
    env = [{"name": "HOME", "value": "/tmp"}, *_secret_env(spec), *(dict(e) for e in spec.runtime.env)]
    return {
        "name": "runtime",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["kunlun-runtime"],
        "args": runtime_args(spec, path),
        "ports": [{"name": names.RUNTIME_PORT_NAME, "containerPort": names.RUNTIME_PORT, "protocol": "TCP"}],
        "env": env,
        "resources": _resources(spec),
        "startupProbe": _probe(
            STARTUP_PERIOD_SECONDS, math.ceil(startup_budget_seconds(spec) / STARTUP_PERIOD_SECONDS)
        ),
        "readinessProbe": _probe(5, 3),
        "livenessProbe": _probe(15, 4),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(DRAIN_SECONDS)]}}},
        "securityContext": dict(RESTRICTED_CONTAINER),
        "volumeMounts": mounts,
    }


def _preflight_container(spec: InferenceSpec, image: str, host: PreflightHost) -> dict[str, Any]:
    """``kunlun-runtime preflight`` on the cards kubelet allocates to it, with the node's files."""
    driver, firmware, kml = spec.versions.locked_versions()
    xpus = str(spec.resources.xpus)
    args = [
        "preflight",
        "--expect-driver",
        driver,
        "--expect-firmware",
        firmware,
        "--expect-kml",
        kml,
        "--min-cards",
        xpus,
        "--require-allocation",
        "--dev-root",
        "/",
    ]
    mounts = []
    if host.kml_version_file is not None:
        args += ["--kml-version-file", preflight_kml_path(host.kml_version_file)]
        _, mount_path = preflight_kml_mount(host.kml_version_file)
        mounts.append({"name": PREFLIGHT_KML_VOLUME, "mountPath": mount_path, "readOnly": True})
    if host.xpu_smi is not None:
        args += ["--xpu-smi", PREFLIGHT_XPU_SMI_PATH]
        mounts.append(
            {"name": PREFLIGHT_XPU_SMI_VOLUME, "mountPath": PREFLIGHT_XPU_SMI_PATH, "readOnly": True}
        )
    return {
        "name": "preflight",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["kunlun-runtime"],
        "args": args,
        "resources": {"requests": {names.RESOURCE_NAME: xpus}, "limits": {names.RESOURCE_NAME: xpus}},
        "securityContext": dict(RESTRICTED_CONTAINER),
        **({"volumeMounts": mounts} if mounts else {}),
    }


def _preflight_volumes(host: PreflightHost) -> list[dict[str, Any]]:
    volumes = []
    if host.kml_version_file is not None:
        # The directory, with no type check (""): a node without it gets an empty one from the
        # container runtime, and preflight reports the missing file by name.
        directory, _ = preflight_kml_mount(host.kml_version_file)
        volumes.append({"name": PREFLIGHT_KML_VOLUME, "hostPath": {"path": directory, "type": ""}})
    if host.xpu_smi is not None:
        volumes.append({"name": PREFLIGHT_XPU_SMI_VOLUME, "hostPath": {"path": host.xpu_smi, "type": "File"}})
    return volumes


def _init_containers(
    spec: InferenceSpec, image: str, host: PreflightHost, *, image_volumes: bool
) -> list[dict[str, Any]]:
    inits: list[dict[str, Any]] = []
    source = spec.model.source
    if source.kind == "image" and not image_volumes:
        inits.append(
            {
                "name": "model-fetch",
                "image": source.reference,
                "imagePullPolicy": source.pull_policy,
                "command": ["sh", "-c", f"cp -a /models/. {names.MODEL_MOUNT_PATH}/"],
                "securityContext": dict(RESTRICTED_CONTAINER),
                "volumeMounts": [{"name": MODEL_VOLUME, "mountPath": names.MODEL_MOUNT_PATH}],
            }
        )
    if spec.versions.policy == "Strict":
        inits.append(_preflight_container(spec, image, host))
    return inits


def _model_volume(spec: InferenceSpec, *, image_volumes: bool) -> dict[str, Any]:
    source = spec.model.source
    if source.kind == "pvc":
        return {
            "name": MODEL_VOLUME,
            "persistentVolumeClaim": {"claimName": source.claim_name, "readOnly": True},
        }
    if source.kind == "hostPath":
        return {"name": MODEL_VOLUME, "hostPath": {"path": source.path, "type": "Directory"}}
    if image_volumes:
        return {
            "name": MODEL_VOLUME,
            "image": {"reference": source.reference, "pullPolicy": source.pull_policy},
        }
    return {"name": MODEL_VOLUME, "emptyDir": {}}


def build_pod_spec(
    ref: ServiceRef,
    spec: InferenceSpec,
    image: str,
    *,
    image_volumes: bool,
    xpu_health_gate: bool = True,
    preflight_host: PreflightHost = DEFAULT_PREFLIGHT_HOST,
) -> dict[str, Any]:
    """The runtime pod; ``xpu_health_gate``: the readiness gate on the node agent's condition (off
    only where no node agent sets it: a gate nobody sets keeps the pod NotReady forever);
    ``preflight_host``: the node's files the Strict preflight mounts."""
    path = model_path(spec, image_volumes=image_volumes)
    node_selector = {names.LABEL_PRESENT: "true", **spec.scheduling.node_selector}
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
        "nodeSelector": node_selector,
        "tolerations": [
            {"key": names.RESOURCE_NAME, "operator": "Exists", "effect": "NoSchedule"},
            *(dict(t) for t in spec.scheduling.tolerations),
        ],
    }
    if xpu_health_gate:
        # The node agent sets this condition on every pod holding a card (False while a card is
        # unhealthy): a pod on a failed card leaves the Service's endpoints at once.
        pod["readinessGates"] = [{"conditionType": names.XPU_HEALTHY_CONDITION}]
    affinity = build_affinity(spec)
    if affinity:
        pod["affinity"] = affinity
    if spec.scheduling.priority_class_name:
        pod["priorityClassName"] = spec.scheduling.priority_class_name
    inits = _init_containers(spec, image, preflight_host, image_volumes=image_volumes)
    if inits:
        pod["initContainers"] = inits
    pod["containers"] = [_runtime_container(spec, image, path)]
    pod["volumes"] = [
        _model_volume(spec, image_volumes=image_volumes),
        {"name": "config", "configMap": {"name": names.owned_name(ref.name, names.CONFIGMAP)}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "shm", "emptyDir": {"medium": "Memory"}},
    ]
    if spec.versions.policy == "Strict":
        pod["volumes"] += _preflight_volumes(preflight_host)
    return pod


def build_deployment(
    ref: ServiceRef,
    spec: InferenceSpec,
    *,
    image: str,
    config_hash: str,
    image_volumes: bool,
    replicas: int,
    xpu_health_gate: bool = True,
    preflight_host: PreflightHost = DEFAULT_PREFLIGHT_HOST,
) -> dict[str, Any]:
    """The runtime Deployment with ``replicas`` replicas."""
    deploy_spec: dict[str, Any] = {"replicas": replicas}
    deploy_spec.update(
        {
            "selector": {"matchLabels": names.selector_labels(ref.name)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": spec.max_surge, "maxUnavailable": spec.max_unavailable},
            },
            "revisionHistoryLimit": 3,
            "progressDeadlineSeconds": startup_budget_seconds(spec) + 300,
            "template": {
                "metadata": {
                    "labels": names.common_labels(ref.name),
                    "annotations": {names.ANNOTATION_CONFIG_HASH: config_hash},
                },
                "spec": build_pod_spec(
                    ref,
                    spec,
                    image,
                    image_volumes=image_volumes,
                    xpu_health_gate=xpu_health_gate,
                    preflight_host=preflight_host,
                ),
            },
        }
    )
    return {
        **header(names.DEPLOYMENT),
        "metadata": build_metadata(ref, names.DEPLOYMENT),
        "spec": deploy_spec,
    }

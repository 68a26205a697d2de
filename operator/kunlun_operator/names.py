"""Names the operator shares with the cluster: API group, label and annotation keys, ports.

Invariant: these strings are a contract with objects already in clusters (and with the chart and
the device plugin's labeler); change them only together with those. The node label keys come from
``kunlun_device.labels`` so that the labeler and the version lock can never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

from kunlun_device.labels import (
    DRA_DRIVER,
    LABEL_COUNT,
    LABEL_DRIVER_VERSION,
    LABEL_FIRMWARE_VERSION,
    LABEL_KML_VERSION,
    LABEL_PRESENT,
    LABEL_PRODUCT,
    RESOURCE_NAME,
    XPU_HEALTHY_CONDITION,
)

__all__ = [
    "DRA_DRIVER",
    "LABEL_COUNT",
    "LABEL_DRIVER_VERSION",
    "LABEL_FIRMWARE_VERSION",
    "LABEL_KML_VERSION",
    "LABEL_PRESENT",
    "LABEL_PRODUCT",
    "RESOURCE_NAME",
    "XPU_HEALTHY_CONDITION",
]

GROUP = "serving.kunlun.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "KunlunInferenceService"
PLURAL = "kunluninferenceservices"

#: The Prometheus Operator's API group (ServiceMonitor, PrometheusRule), discovered at run time.
MONITORING_GROUP_VERSION = "monitoring.coreos.com/v1"

#: LeaderWorkerSet (kubernetes-sigs/lws): multi-node replicas, discovered at run time. Its label on
#: every pod of a group: the pod's index in its group, "0" on the leader (LWS reference, "Labels,
#: Annotations and Environment Variables"), and the environment LWS injects into every container.
LWS_GROUP_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_LABEL_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_LEADER_INDEX = "0"
LWS_ENV_WORKER_INDEX = "LWS_WORKER_INDEX"
LWS_ENV_LEADER_ADDRESS = "LWS_LEADER_ADDRESS"
#: The torch.distributed rendezvous port of a multi-node group (``--master-port``, on the leader).
RENDEZVOUS_PORT = 29500
RENDEZVOUS_PORT_NAME = "dist"

#: The Gateway API Inference Extension's InferencePool and Gateway API's HTTPRoute: prefix-aware
#: routing (``spec.routing``), discovered at run time. The Endpoint Picker also reads the extension's
#: InferenceObjectives and InferenceModelRewrites (its Role grants them).
INFERENCE_GROUP_VERSION = "inference.networking.k8s.io/v1"
GATEWAY_GROUP_VERSION = "gateway.networking.k8s.io/v1"
INFERENCE_X_GROUP = "inference.networking.x-k8s.io"

#: Dynamic Resource Allocation (Kubernetes >= 1.34): the ResourceClaimTemplates of services with
#: ``spec.resources.allocation: dra`` and the ResourceSlices the DRA kubelet plugin publishes (read
#: to explain an unmatched claim); used only with ``--dra``, where the cluster serves it (discovery).
DRA_GROUP_VERSION = "resource.k8s.io/v1"

#: ``--endpoint-picker-image``: the Gateway API Inference Extension's Endpoint Picker, its last
#: release that ships one (v1.5.0; the picker has since moved to llm-d).
DEFAULT_ENDPOINT_PICKER_IMAGE = "registry.k8s.io/gateway-api-inference-extension/epp:v1.5.0"
#: ``--precise-endpoint-picker-image``: llm-d's picker (built on the extension's v1.5.0), whose
#: precise-prefix-cache-scorer indexes the pods' KV events.
DEFAULT_PRECISE_ENDPOINT_PICKER_IMAGE = "ghcr.io/llm-d/llm-d-inference-scheduler:v0.8.0"
#: ``--precise-tokenizer-image``: the tokenizer sidecar of llm-d's picker. Its release build has no
#: tokenizer of its own (only the client of this service, over a Unix socket); v0.7.1 is the
#: llm-d-kv-cache release the picker's v0.8.0 is built with.
DEFAULT_PRECISE_TOKENIZER_IMAGE = "ghcr.io/llm-d/llm-d-uds-tokenizer:v0.7.1"
#: The picker's ports: Envoy's ext-proc (gRPC), the gRPC health service, Prometheus metrics.
PICKER_EXT_PROC_PORT = 9002
PICKER_HEALTH_PORT = 9003
PICKER_METRICS_PORT = 9090
#: The runtime's KV events (vLLM's ZeroMQ PUB socket) on routed precise services; the picker's
#: indexer subscribes to every pod of the pool on this port.
KV_EVENTS_PORT = 5557
KV_EVENTS_PORT_NAME = "kv-events"
#: The runtime's ``--block-size`` when the spec sets none (the picker's indexer must use the same).
RUNTIME_DEFAULT_BLOCK_SIZE = 16

#: ``--default-runtime-image``: the image of a service without ``spec.runtime.image`` only when no
#: compatibility-matrix entry certifying its versions names one (``matrix.select_image``).
DEFAULT_RUNTIME_IMAGE = "ghcr.io/kunlun-inference/kunlun-runtime:0.1.0"

#: Host path of the node's KML version file: the file the labeler reads for the
#: ``kunlun.dev/xpu.kml-version`` label (``kunlun_device.xpu.DEFAULT_KML_VERSION_FILE``, under the
#: chart's ``devicePlugin.hostPaths.kunlunHome``). The preflight init container mounts it.
HOST_KML_VERSION_FILE = "/usr/local/xpu/kml/VERSION"

#: The runtime's HTTP port (OpenAI API, /health, /metrics); the Deployment passes it as ``--port``.
RUNTIME_PORT = 8000
RUNTIME_PORT_NAME = "http"
HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"

#: Where the model and the runtime config are mounted inside the runtime container.
MODEL_MOUNT_PATH = "/models"
CONFIG_MOUNT_PATH = "/etc/kunlun-runtime"

# Labels on every owned object; the first two also select the runtime pods.
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_PART_OF = "app.kubernetes.io/part-of"
APP_NAME = "kunlun-runtime"
PICKER_APP_NAME = "kunlun-endpoint-picker"  # the Endpoint Picker's pods: never selected as runtime pods
MANAGER = "kunlun-operator"

# Annotations the operator writes on what it owns.
ANNOTATION_CONFIG_HASH = f"{GROUP}/config-hash"
ANNOTATION_LAST_APPLIED = f"{GROUP}/last-applied"
FINALIZER = f"{GROUP}/finalizer"


def selector_labels(instance: str) -> dict[str, str]:
    """The labels that select the runtime pods of one KunlunInferenceService."""
    return {LABEL_NAME: APP_NAME, LABEL_INSTANCE: instance}


def leader_selector_labels(instance: str) -> dict[str, str]:
    """The labels that select the leader pods of a multi-node service (the pods that serve HTTP)."""
    return {**selector_labels(instance), LWS_LABEL_WORKER_INDEX: LWS_LEADER_INDEX}


def picker_selector_labels(instance: str) -> dict[str, str]:
    """The labels that select the Endpoint Picker pods of one routed KunlunInferenceService."""
    return {LABEL_NAME: PICKER_APP_NAME, LABEL_INSTANCE: instance}


def common_labels(instance: str) -> dict[str, str]:
    """The labels on every object the operator owns for one KunlunInferenceService."""
    return {
        **selector_labels(instance),
        LABEL_COMPONENT: "inference",
        LABEL_PART_OF: "kunlun-inference",
        LABEL_MANAGED_BY: MANAGER,
    }


def selector_string(instance: str) -> str:
    """``status.selector``: the pod selector in label-selector string form (scale subresource)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(instance).items()))


@dataclass(frozen=True, slots=True)
class Kind:
    """One API kind the operator owns: where it lives in the API and how it is addressed."""

    api_version: str  # "apps/v1", "v1"
    kind: str  # "Deployment"
    plural: str  # "deployments"
    #: Appended to the service's name in the object's name: told apart from the service's other
    #: object of the same kind (the Endpoint Picker's ``-epp`` Deployment, Service, ConfigMap).
    suffix: str = ""


CONFIGMAP = Kind("v1", "ConfigMap", "configmaps")
SERVICE = Kind("v1", "Service", "services")
DEPLOYMENT = Kind("apps/v1", "Deployment", "deployments")
LEADER_WORKER_SET = Kind(LWS_GROUP_VERSION, "LeaderWorkerSet", "leaderworkersets")
PDB = Kind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets")
HPA = Kind("autoscaling/v2", "HorizontalPodAutoscaler", "horizontalpodautoscalers")
SERVICE_MONITOR = Kind(MONITORING_GROUP_VERSION, "ServiceMonitor", "servicemonitors")
PROMETHEUS_RULE = Kind(MONITORING_GROUP_VERSION, "PrometheusRule", "prometheusrules")
KIS = Kind(API_VERSION, KIND, PLURAL)
# Routing (spec.routing.type InferencePool): the pool, its route and the Endpoint Picker's objects.
PICKER_SUFFIX = "-epp"
PICKER_SERVICE_ACCOUNT = Kind("v1", "ServiceAccount", "serviceaccounts", PICKER_SUFFIX)
PICKER_ROLE = Kind("rbac.authorization.k8s.io/v1", "Role", "roles", PICKER_SUFFIX)
PICKER_ROLE_BINDING = Kind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings", PICKER_SUFFIX)
PICKER_CONFIGMAP = Kind("v1", "ConfigMap", "configmaps", PICKER_SUFFIX)
PICKER_DEPLOYMENT = Kind("apps/v1", "Deployment", "deployments", PICKER_SUFFIX)
PICKER_SERVICE = Kind("v1", "Service", "services", PICKER_SUFFIX)
INFERENCE_POOL = Kind(INFERENCE_GROUP_VERSION, "InferencePool", "inferencepools")
HTTP_ROUTE = Kind(GATEWAY_GROUP_VERSION, "HTTPRoute", "httproutes")
#: A DRA service's claim template: named ``<service>-xpus-<hash of its spec>`` (a template's spec
#: cannot change, so a new spec is a new template), the stale ones pruned by label.
RESOURCE_CLAIM_TEMPLATE = Kind(DRA_GROUP_VERSION, "ResourceClaimTemplate", "resourceclaimtemplates", "-xpus")
RESOURCE_SLICE = Kind(DRA_GROUP_VERSION, "ResourceSlice", "resourceslices")  # read, never owned
#: The Endpoint Picker's own objects (core and RBAC kinds), in apply order.
PICKER_KINDS = (
    PICKER_SERVICE_ACCOUNT,
    PICKER_ROLE,
    PICKER_ROLE_BINDING,
    PICKER_CONFIGMAP,
    PICKER_DEPLOYMENT,
    PICKER_SERVICE,
)
#: Every kind of a routed service, in apply order: the picker before the pool naming it, the
#: pool before the route naming it.
ROUTING_KINDS = (*PICKER_KINDS, INFERENCE_POOL, HTTP_ROUTE)

#: Every kind the operator may own, in the order it applies them (config before its consumers).
OWNED_KINDS: tuple[Kind, ...] = (
    CONFIGMAP,
    SERVICE,
    DEPLOYMENT,
    LEADER_WORKER_SET,
    PDB,
    HPA,
    SERVICE_MONITOR,
    PROMETHEUS_RULE,
    *ROUTING_KINDS,
    RESOURCE_CLAIM_TEMPLATE,
)
MONITORING_KINDS = frozenset({SERVICE_MONITOR, PROMETHEUS_RULE})
#: Kinds whose objects are named by their content: the controller lists the service's objects of
#: the kind (by its labels) and deletes those the plan does not name, instead of one fixed name.
PRUNED_KINDS = frozenset({RESOURCE_CLAIM_TEMPLATE})


def owned_name(instance: str, kind: Kind) -> str:
    """The name of the object of ``kind`` owned by the service ``instance`` (deterministic).

    The LeaderWorkerSet gets a suffix: LWS creates a headless Service named like itself for its
    pods' DNS names (``LWS_LEADER_ADDRESS``) and skips that when a Service of the name exists, so
    it must not share its name with the service's own (ClusterIP) Service.
    """
    if kind.suffix:
        return f"{instance}{kind.suffix}"
    if kind == CONFIGMAP:
        return f"{instance}-config"
    if kind == LEADER_WORKER_SET:
        return f"{instance}-lws"
    return instance

"""The KunlunInferenceService spec as typed values: frozen dataclasses, the choices each field
admits, and the CRD's defaults.

Owns: the spec's Python shape after parsing (``spec/service.py`` parses into it); quantities are
numbers here (bytes, seconds), never strings. Must not parse or talk to the API; the one check
here, ``VersionsSpec.required``, names its field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from kunlun_operator.errors import SpecError

SourceKind = Literal["pvc", "hostPath", "image"]
Policy = Literal["Strict", "Warn", "Off"]
Dtype = Literal["auto", "bfloat16", "float16", "float32"]
Quantization = Literal["int8"]  # what `kunlun-runtime serve --quantization` accepts
Metric = Literal["requestsWaiting", "requestsRunning", "kvCacheUsage"]
ServiceType = Literal["ClusterIP", "NodePort", "LoadBalancer"]
PullPolicy = Literal["Always", "IfNotPresent", "Never"]
RoutingType = Literal["Service", "InferencePool"]
FailureMode = Literal["FailOpen", "FailClose"]  # the InferencePool's endpointPickerRef.failureMode
#: How the pods get their cards: the device plugin's extended resource, or a DRA ResourceClaim.
Allocation = Literal["devicePlugin", "dra"]
SpeculativeMethod = Literal["ngram", "suffix"]  # vLLM's model-free drafting methods

SOURCE_KINDS: tuple[SourceKind, ...] = get_args(SourceKind)
POLICIES: tuple[Policy, ...] = get_args(Policy)
DTYPES: tuple[Dtype, ...] = get_args(Dtype)
QUANTIZATIONS: tuple[Quantization, ...] = get_args(Quantization)
BLOCK_SIZES = (8, 16, 32, 64, 128)
METRICS: tuple[Metric, ...] = get_args(Metric)
SERVICE_TYPES: tuple[ServiceType, ...] = get_args(ServiceType)
PULL_POLICIES: tuple[PullPolicy, ...] = get_args(PullPolicy)
ROUTING_TYPES: tuple[RoutingType, ...] = get_args(RoutingType)
FAILURE_MODES: tuple[FailureMode, ...] = get_args(FailureMode)
ALLOCATIONS: tuple[Allocation, ...] = get_args(Allocation)
SPECULATIVE_METHODS: tuple[SpeculativeMethod, ...] = get_args(SpeculativeMethod)
#: The most Endpoint Picker replicas ``spec.routing.picker.replicas`` allows.
MAX_PICKER_REPLICAS = 10
#: The autoscaling target used when ``spec.autoscaling.target`` is not set, per metric.
DEFAULT_TARGETS: Mapping[Metric, float] = {
    "requestsWaiting": 4.0,
    "requestsRunning": 16.0,
    "kvCacheUsage": 0.8,
}
#: The most pipeline stages (nodes per replica) ``spec.runtime.pipelineParallelSize`` allows.
MAX_PIPELINE_PARALLEL_SIZE = 16
#: The largest ``spec.runtime.lora.maxLoraRank`` (vLLM's limit) and the most adapters one service lists.
MAX_LORA_RANK = 512
MAX_ADAPTERS = 64
#: Longer than the device plugin's recovery period (60 s by default): a transient fault that clears
#: within it readmits the pod through the readiness gate instead of costing a model load.
DEFAULT_REPLACE_AFTER = "2m"


@dataclass(frozen=True, slots=True)
class ModelSource:
    kind: SourceKind
    claim_name: str | None = None  # pvc
    path: str = ""  # pvc: sub-path inside the claim; hostPath: the host directory
    reference: str | None = None  # image
    pull_policy: PullPolicy = "IfNotPresent"  # image


@dataclass(frozen=True, slots=True)
class Architecture:
    num_layers: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True, slots=True)
class Adapter:
    """One LoRA adapter (``spec.model.adapters[]``): served under ``name``, read from ``source``
    (a PEFT directory, mounted read-only like the model)."""

    name: str
    source: ModelSource
    size_bytes: int | None = None  # from "64Mi": what memory feasibility counts; None: not counted


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str  # the served model name
    source: ModelSource
    num_parameters: int | None = None  # from "7B" / "135M"
    architecture: Architecture | None = None
    adapters: tuple[Adapter, ...] = ()  # served beside the base model (``--lora-modules``)


@dataclass(frozen=True, slots=True)
class LoRASpec:
    """The runtime's LoRA limits (``spec.runtime.lora``, vLLM's flags) and how adapter changes
    reach the pods (docs/operator.md "LoRA adapters")."""

    max_loras: int = 1  # --max-loras: distinct adapters in one batch
    max_lora_rank: int = 16  # --max-lora-rank
    max_cpu_loras: int | None = None  # --max-cpu-loras; None: the runtime's default (max_loras)
    #: The operator loads and unloads adapters on the running pods through the runtime's API
    #: (``--allow-runtime-lora-updating``) instead of rolling them.
    runtime_updates: bool = False


@dataclass(frozen=True, slots=True)
class SpeculativeSpec:
    """Speculative decoding (``spec.runtime.speculative``, vLLM's ``--speculative-config``). The
    field names are vLLM's keys, which the flag's JSON uses as they are; a None field is unset:
    left out of the flag, so the runtime's default applies."""

    method: SpeculativeMethod = "ngram"
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int | None = None  # ngram only
    prompt_lookup_min: int | None = None  # ngram only
    suffix_decoding_max_tree_depth: int | None = None  # suffix only
    suffix_decoding_max_cached_requests: int | None = None  # suffix only; 0: no cross-request tree
    suffix_decoding_max_spec_factor: float | None = None  # suffix only
    suffix_decoding_min_token_prob: float | None = None  # suffix only


@dataclass(frozen=True, slots=True)
class RuntimeSpec:
    image: str | None = None  # None: the compatibility-matrix entry's image (matrix.select_image)
    dtype: Dtype = "auto"
    quantization: Quantization | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    kv_cache_memory_bytes: int | None = None  # from "20Gi"
    tensor_parallel_size: int = 1  # cards one pod's engine is split over
    #: Pipeline stages = pods (nodes) per replica; above 1 a replica is a LeaderWorkerSet group.
    pipeline_parallel_size: int = 1
    enable_prefix_caching: bool | None = None
    extra_args: tuple[str, ...] = ()
    env: tuple[Mapping[str, Any], ...] = ()
    startup_timeout_seconds: int | None = None
    lora: LoRASpec | None = None  # None: no adapters and no ``runtime.lora``; LoRA off
    speculative: SpeculativeSpec | None = None  # None: no ``runtime.speculative``; off


@dataclass(frozen=True, slots=True)
class VersionsSpec:
    driver: str | None  # None only under policy Off
    firmware: str | None
    kml: str | None
    policy: Policy = "Strict"

    def locked_versions(self) -> tuple[str, str, str]:
        """``(driver, firmware, kml)`` that the pods are locked to (Strict) or checked against (Warn).

        Raises:
            SpecError: one of them is unset, which ``parse_spec`` allows only under policy Off.
        """
        if self.driver is None or self.firmware is None or self.kml is None:
            raise SpecError("spec.versions", "driver, firmware and kml are required unless policy is Off")
        return self.driver, self.firmware, self.kml


@dataclass(frozen=True, slots=True)
class ResourcesSpec:
    xpus: int = 1
    cpu: str | None = None
    memory: str | None = None
    xpu_product: str | None = None
    #: ``dra``: the cards are asked for through a ResourceClaimTemplate (driver ``xpu.kunlun.dev``)
    #: instead of the ``kunlunxin.com/xpu`` extended resource (docs/operator.md "Allocation").
    allocation: Allocation = "devicePlugin"

    @property
    def dra(self) -> bool:
        """The pods claim their cards through Dynamic Resource Allocation."""
        return self.allocation == "dra"


@dataclass(frozen=True, slots=True)
class AutoscalingSpec:
    enabled: bool = False
    min_replicas: int = 1
    max_replicas: int | None = None
    metric: Metric = "requestsWaiting"
    target: float | None = None

    @property
    def effective_target(self) -> float:
        return self.target if self.target is not None else DEFAULT_TARGETS[self.metric]


@dataclass(frozen=True, slots=True)
class SchedulingSpec:
    node_selector: Mapping[str, str]
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] | None = None
    priority_class_name: str | None = None


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    type: ServiceType = "ClusterIP"
    port: int = 8000
    annotations: Mapping[str, str] | None = None


@dataclass(frozen=True, slots=True)
class MonitoringSpec:
    service_monitor: bool = True
    prometheus_rule: bool = True
    interval: str = "30s"
    labels: Mapping[str, str] | None = None


@dataclass(frozen=True, slots=True)
class FaultToleranceSpec:
    """What happens to a replica whose card fails (docs/operator.md, "Replicas on a failed card")."""

    replace_after_seconds: float = 120.0  # unhealthy this long → evicted (PDB respected)


@dataclass(frozen=True, slots=True)
class SecretKeyRef:
    """One key of a Secret in the service's namespace (``{name, key}``)."""

    name: str
    key: str


@dataclass(frozen=True, slots=True)
class GatewayRef:
    """The Gateway listener an HTTPRoute attaches the service's InferencePool to."""

    name: str
    namespace: str | None = None  # None: the service's namespace
    section_name: str | None = None  # None: every listener that allows the route


@dataclass(frozen=True, slots=True)
class PickerSpec:
    """The Endpoint Picker (EPP) the InferencePool names."""

    replicas: int = 1
    image: str | None = None  # None: the operator's default picker image (precise or not)
    failure_mode: FailureMode = "FailOpen"
    resources: Mapping[str, Any] | None = None  # a core/v1 ResourceRequirements; None: the default


@dataclass(frozen=True, slots=True)
class RoutingSpec:
    """How requests reach the replicas (``spec.routing``): the Service alone, or an InferencePool
    with its Endpoint Picker (prefix-, queue- and KV-cache-aware, docs/operator.md "Routing")."""

    type: RoutingType = "Service"
    #: Index the pods' prefix caches from their KV events instead of estimating them.
    precise: bool = False
    gateway: GatewayRef | None = None  # an HTTPRoute from this Gateway to the pool; None: no route
    picker: PickerSpec = PickerSpec()
    #: PYTHONHASHSEED of the pods and the indexer's hashSeed (precise); None: derived from the name.
    hash_seed: str | None = None

    @property
    def inference_pool(self) -> bool:
        """Routed through an InferencePool and its Endpoint Picker."""
        return self.type == "InferencePool"


@dataclass(frozen=True, slots=True)
class InferenceSpec:
    """The whole ``spec`` of a KunlunInferenceService, defaults applied."""

    model: ModelSpec
    runtime: RuntimeSpec
    versions: VersionsSpec
    resources: ResourcesSpec
    replicas: int
    autoscaling: AutoscalingSpec
    scheduling: SchedulingSpec
    service: ServiceSpec
    monitoring: MonitoringSpec
    max_surge: int | str = 1
    max_unavailable: int | str = 0
    disruption_max_unavailable: int | str = 1
    api_key_secret: SecretKeyRef | None = None  # → env VLLM_API_KEY of the runtime
    metrics_token_secret: SecretKeyRef | None = None  # → env KUNLUN_METRICS_TOKEN; ServiceMonitor auth
    fault_tolerance: FaultToleranceSpec = FaultToleranceSpec()
    routing: RoutingSpec = RoutingSpec()

    @property
    def multi_node(self) -> bool:
        """A replica spans several pods (nodes): served by a LeaderWorkerSet, not a Deployment."""
        return self.runtime.pipeline_parallel_size > 1

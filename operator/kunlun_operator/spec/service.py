"""Parse a KunlunInferenceService, once, into the typed values of ``spec/values.py``.

Owns: the spec's Python shape and its defaults (the same defaults the CRD declares, so an object
that skipped API-server defaulting parses identically), and the cross-field checks the CRD's CEL
rules also make. Must not talk to the API. Invariant: every ``SpecError`` names the field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn, TypeAlias

from kunlun_operator.errors import SpecError
from kunlun_operator.spec.fields import (
    read_bool,
    read_choice,
    read_int,
    read_int_or_str,
    read_list,
    read_number,
    read_obj,
    read_str,
    read_string_map,
)
from kunlun_operator.spec.quantity import parse_bytes, parse_duration_seconds, parse_parameters
from kunlun_operator.spec.routing import check_routing, parse_routing
from kunlun_operator.spec.sources import parse_adapters, parse_lora, parse_source
from kunlun_operator.spec.speculative import parse_speculative
from kunlun_operator.spec.values import (
    ALLOCATIONS,
    BLOCK_SIZES,
    DEFAULT_REPLACE_AFTER,
    DTYPES,
    MAX_PIPELINE_PARALLEL_SIZE,
    METRICS,
    POLICIES,
    QUANTIZATIONS,
    SERVICE_TYPES,
    Architecture,
    AutoscalingSpec,
    FaultToleranceSpec,
    InferenceSpec,
    ModelSpec,
    MonitoringSpec,
    ResourcesSpec,
    RuntimeSpec,
    SchedulingSpec,
    SecretKeyRef,
    ServiceSpec,
    VersionsSpec,
)

_VERSION = re.compile(r"^[0-9A-Za-z]([0-9A-Za-z._-]{0,61}[0-9A-Za-z])?$")
_INTERVAL = re.compile(r"^[0-9]+(ms|s|m|h)$")
_SECRET_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")  # a DNS-1123 subdomain
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]{1,253}$")


@dataclass(frozen=True, slots=True)
class ServiceRef:
    """The identity of one KunlunInferenceService (what owner references and events need)."""

    name: str
    namespace: str
    uid: str
    generation: int
    deleting: bool = False  # ``metadata.deletionTimestamp`` is set


#: A spec as parsed: its typed values, or the error naming the field that makes it invalid (an
#: invalid spec is no exception for the reconcile: it becomes a Failed status).
ParsedSpec: TypeAlias = InferenceSpec | SpecError


@dataclass(frozen=True, slots=True)
class ParsedService:
    """One KunlunInferenceService read once, the only reader of its shape: identity, spec, and the
    status the operator last wrote (kept as written: the reconcile merges into it)."""

    ref: ServiceRef
    spec: ParsedSpec
    status: Mapping[str, Any]

    @property
    def reconciled_this_generation(self) -> bool:
        """The operator's last pass saw this generation and did not fail it, so the objects it
        applies now existed before (what ``apply`` needs to tell drift from a first create)."""
        return (
            self.status.get("observedGeneration") == self.ref.generation
            and self.status.get("phase") != "Failed"
        )


# --- parsing -----------------------------------------------------------------------------------------


def parse_service(body: Mapping[str, Any]) -> ParsedService:
    """The custom resource ``body`` parsed once; an invalid spec is held, not raised."""
    return ParsedService(
        ref=parse_service_ref(body),
        spec=parse_spec_or_error(body.get("spec") or {}),
        status=body.get("status") or {},
    )


def parse_service_ref(body: Mapping[str, Any]) -> ServiceRef:
    """The identity of the custom resource ``body`` (its ``metadata``)."""
    meta = body.get("metadata") or {}
    return ServiceRef(
        name=meta["name"],
        namespace=meta.get("namespace") or "default",
        uid=meta.get("uid", ""),
        generation=int(meta.get("generation") or 0),
        deleting=bool(meta.get("deletionTimestamp")),
    )


def parse_spec_or_error(spec: Mapping[str, Any] | None) -> ParsedSpec:
    """``parse_spec(spec)``, or the ``SpecError`` it raises."""
    try:
        return parse_spec(spec)
    except SpecError as error:
        return error


def parse_spec(spec: Mapping[str, Any] | None) -> InferenceSpec:
    """Parse ``spec`` of a KunlunInferenceService, applying the CRD's defaults.

    Raises:
        SpecError: a field is missing, of the wrong type, out of bounds, or inconsistent with
            another; ``field`` is its path (``spec.autoscaling.maxReplicas``).
    """
    if not isinstance(spec, Mapping):
        raise SpecError("spec", "is required")
    p = "spec"
    model = _parse_model(read_obj(spec, "model", p, required=True))
    runtime = _parse_runtime(read_obj(spec, "runtime", p), has_adapters=bool(model.adapters))
    versions = _parse_versions(read_obj(spec, "versions", p, required=True))
    resources = _parse_resources(read_obj(spec, "resources", p))
    autoscaling = _parse_autoscaling(read_obj(spec, "autoscaling", p))
    rollout = read_obj(spec, "rollout", p)
    max_surge = read_int_or_str(rollout, "maxSurge", "spec.rollout", 1)
    max_unavailable = read_int_or_str(rollout, "maxUnavailable", "spec.rollout", 0)
    if max_surge in (0, "0%") and max_unavailable in (0, "0%"):
        raise SpecError("spec.rollout", "maxSurge and maxUnavailable cannot both be 0")
    if resources.xpus % runtime.tensor_parallel_size:
        raise SpecError(
            "spec.resources.xpus",
            f"{resources.xpus} is not a multiple of "
            f"spec.runtime.tensorParallelSize ({runtime.tensor_parallel_size})",
        )
    stages = runtime.pipeline_parallel_size
    if model.architecture is not None and stages > model.architecture.num_layers:
        raise SpecError(
            "spec.runtime.pipelineParallelSize",
            f"{stages} stages exceed spec.model.architecture.numLayers ({model.architecture.num_layers}): "
            "every stage needs at least one layer",
        )
    metrics_token_secret = _parse_secret_ref(spec, "metricsTokenSecretRef")
    routing = parse_routing(read_obj(spec, "routing", p))
    check_routing(routing, runtime, metrics_token_secret)
    return InferenceSpec(
        model=model,
        runtime=runtime,
        versions=versions,
        resources=resources,
        replicas=read_int(spec, "replicas", p, minimum=0, default=1),
        autoscaling=autoscaling,
        scheduling=_parse_scheduling(read_obj(spec, "scheduling", p)),
        service=_parse_service(read_obj(spec, "service", p)),
        monitoring=_parse_monitoring(read_obj(spec, "monitoring", p)),
        max_surge=max_surge,
        max_unavailable=max_unavailable,
        disruption_max_unavailable=read_int_or_str(
            read_obj(spec, "disruption", p), "maxUnavailable", "spec.disruption", 1
        ),
        api_key_secret=_parse_secret_ref(spec, "apiKeySecretRef"),
        metrics_token_secret=metrics_token_secret,
        fault_tolerance=_parse_fault_tolerance(read_obj(spec, "faultTolerance", p)),
        routing=routing,
    )


def _parse_model(model: Mapping[str, Any]) -> ModelSpec:
    p = "spec.model"
    parsed = parse_source(read_obj(model, "source", p, required=True), f"{p}.source")
    name = read_str(model, "name", p, required=True)
    parameters = read_str(model, "parameters", p)
    arch = read_obj(model, "architecture", p)
    ap = f"{p}.architecture"
    return ModelSpec(
        name=name,
        source=parsed,
        num_parameters=parse_parameters(parameters, f"{p}.parameters") if parameters else None,
        architecture=Architecture(
            num_layers=read_int(arch, "numLayers", ap, minimum=1) or _missing(f"{ap}.numLayers"),
            num_kv_heads=read_int(arch, "numKVHeads", ap, minimum=1) or _missing(f"{ap}.numKVHeads"),
            head_dim=read_int(arch, "headDim", ap, minimum=1) or _missing(f"{ap}.headDim"),
        )
        if arch
        else None,
        adapters=parse_adapters(model, name),
    )


def _parse_fault_tolerance(ft: Mapping[str, Any]) -> FaultToleranceSpec:
    p = "spec.faultTolerance"
    text = read_str(ft, "replaceAfter", p, default=DEFAULT_REPLACE_AFTER)
    return FaultToleranceSpec(replace_after_seconds=parse_duration_seconds(text, f"{p}.replaceAfter"))


def _parse_secret_ref(spec: Mapping[str, Any], key: str) -> SecretKeyRef | None:
    if spec.get(key) is None:
        return None
    ref = read_obj(spec, key, "spec")
    p = f"spec.{key}"
    return SecretKeyRef(
        name=read_str(ref, "name", p, required=True, pattern=_SECRET_NAME),
        key=read_str(ref, "key", p, required=True, pattern=_SECRET_KEY),
    )


def _missing(field: str) -> NoReturn:
    raise SpecError(field, "is required")


def _parse_runtime(rt: Mapping[str, Any], *, has_adapters: bool) -> RuntimeSpec:
    p = "spec.runtime"
    args = read_list(rt, "extraArgs", p)
    for i, arg in enumerate(args):
        if not isinstance(arg, str):
            raise SpecError(f"{p}.extraArgs[{i}]", f"must be a string, got {arg!r}")
    env = read_list(rt, "env", p)
    for i, var in enumerate(env):
        if not isinstance(var, Mapping) or not isinstance(var.get("name"), str) or not var["name"]:
            raise SpecError(f"{p}.env[{i}].name", "is required")
    block_size = read_int(rt, "blockSize", p)
    if block_size is not None and block_size not in BLOCK_SIZES:
        raise SpecError(
            f"{p}.blockSize", f"must be one of {', '.join(map(str, BLOCK_SIZES))}; got {block_size}"
        )
    kv = rt.get("kvCacheMemory")
    kv_bytes = None if kv is None else parse_bytes(kv, f"{p}.kvCacheMemory")
    return RuntimeSpec(
        image=read_str(rt, "image", p),
        dtype=read_choice(rt, "dtype", p, DTYPES, default="auto"),
        quantization=read_choice(rt, "quantization", p, QUANTIZATIONS),
        max_model_len=read_int(rt, "maxModelLen", p, minimum=1),
        max_num_seqs=read_int(rt, "maxNumSeqs", p, minimum=1),
        max_num_batched_tokens=read_int(rt, "maxNumBatchedTokens", p, minimum=1),
        block_size=block_size,
        kv_cache_memory_bytes=kv_bytes,
        tensor_parallel_size=read_int(rt, "tensorParallelSize", p, minimum=1, maximum=16, default=1),
        pipeline_parallel_size=read_int(
            rt, "pipelineParallelSize", p, minimum=1, maximum=MAX_PIPELINE_PARALLEL_SIZE, default=1
        ),
        enable_prefix_caching=read_bool(rt, "enablePrefixCaching", p, None),
        extra_args=tuple(args),
        env=tuple(dict(v) for v in env),
        startup_timeout_seconds=read_int(rt, "startupTimeoutSeconds", p, minimum=30),
        lora=parse_lora(rt, has_adapters=has_adapters),
        speculative=parse_speculative(rt),
    )


def _parse_versions(v: Mapping[str, Any]) -> VersionsSpec:
    p = "spec.versions"
    policy = read_choice(v, "policy", p, POLICIES, default="Strict")
    required = policy != "Off"
    return VersionsSpec(
        driver=read_str(v, "driver", p, required=required, pattern=_VERSION),
        firmware=read_str(v, "firmware", p, required=required, pattern=_VERSION),
        kml=read_str(v, "kml", p, required=required, pattern=_VERSION),
        policy=policy,
    )


def _parse_resources(r: Mapping[str, Any]) -> ResourcesSpec:
    p = "spec.resources"
    quantities: dict[str, str | None] = {}
    for key in ("cpu", "memory"):
        value = r.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | str)):
            raise SpecError(f"{p}.{key}", f"must be a quantity, got {value!r}")
        quantities[key] = None if value is None else str(value)
    return ResourcesSpec(
        xpus=read_int(r, "xpus", p, minimum=1, maximum=16, default=1),
        cpu=quantities["cpu"],
        memory=quantities["memory"],
        xpu_product=read_str(r, "xpuProduct", p, pattern=_VERSION),
        allocation=read_choice(r, "allocation", p, ALLOCATIONS, default="devicePlugin"),
    )


def _parse_autoscaling(a: Mapping[str, Any]) -> AutoscalingSpec:
    p = "spec.autoscaling"
    parsed = AutoscalingSpec(
        enabled=read_bool(a, "enabled", p, False),
        min_replicas=read_int(a, "minReplicas", p, minimum=1, default=1),
        max_replicas=read_int(a, "maxReplicas", p, minimum=1),
        metric=read_choice(a, "metric", p, METRICS, default="requestsWaiting"),
        target=read_number(a, "target", p, above=0.0),
    )
    if parsed.enabled and parsed.max_replicas is None:
        raise SpecError(f"{p}.maxReplicas", "is required when autoscaling is enabled")
    if parsed.max_replicas is not None and parsed.min_replicas > parsed.max_replicas:
        raise SpecError(
            f"{p}.minReplicas", f"{parsed.min_replicas} exceeds maxReplicas ({parsed.max_replicas})"
        )
    if parsed.metric == "kvCacheUsage" and parsed.target is not None and parsed.target > 1:
        raise SpecError(f"{p}.target", f"kvCacheUsage is a ratio in (0, 1]; got {parsed.target}")
    return parsed


def _parse_scheduling(s: Mapping[str, Any]) -> SchedulingSpec:
    p = "spec.scheduling"
    tolerations = read_list(s, "tolerations", p)
    for i, tol in enumerate(tolerations):
        if not isinstance(tol, Mapping):
            raise SpecError(f"{p}.tolerations[{i}]", "must be an object")
    affinity = read_obj(s, "affinity", p)
    return SchedulingSpec(
        node_selector=read_string_map(s, "nodeSelector", p),
        tolerations=tuple(dict(t) for t in tolerations),
        affinity=dict(affinity) if affinity else None,
        priority_class_name=read_str(s, "priorityClassName", p),
    )


def _parse_service(s: Mapping[str, Any]) -> ServiceSpec:
    p = "spec.service"
    return ServiceSpec(
        type=read_choice(s, "type", p, SERVICE_TYPES, default="ClusterIP"),
        port=read_int(s, "port", p, minimum=1, maximum=65535, default=8000),
        annotations=read_string_map(s, "annotations", p) or None,
    )


def _parse_monitoring(m: Mapping[str, Any]) -> MonitoringSpec:
    p = "spec.monitoring"
    return MonitoringSpec(
        service_monitor=read_bool(m, "serviceMonitor", p, True),
        prometheus_rule=read_bool(m, "prometheusRule", p, True),
        interval=read_str(m, "interval", p, pattern=_INTERVAL, default="30s"),
        labels=read_string_map(m, "labels", p) or None,
    )

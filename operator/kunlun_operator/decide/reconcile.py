"""Reconcile as a pure function: (parsed custom resource, cluster facts) → objects, status, events.

Owns: which objects exist for a service and what they contain, which must be absent, the status
and the events a user would look for. Must not talk to the API or read the clock (``now`` comes
in). Invariant: the same input gives the same plan, so a restarted operator converges to it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from kunlun_operator import names
from kunlun_operator.builders.configmap import build_configmap, config_hash
from kunlun_operator.builders.deployment import build_deployment
from kunlun_operator.builders.hpa import build_hpa
from kunlun_operator.builders.leaderworkerset import (
    LEADERWORKERSET_RECHECK_SECONDS,
    build_leaderworkerset,
    leaderworkerset_name_error,
    require_leaderworkerset,
)
from kunlun_operator.builders.pdb import build_pdb
from kunlun_operator.builders.pod_template import model_path
from kunlun_operator.builders.prometheusrule import build_prometheusrule
from kunlun_operator.builders.service import build_service, endpoint_url
from kunlun_operator.builders.servicemonitor import build_servicemonitor
from kunlun_operator.decide.adapters import CONDITION_TYPE as ADAPTERS_READY
from kunlun_operator.decide.adapters import AdapterOutcome, AdapterPod, adapters_condition, adapters_status
from kunlun_operator.decide.allocation import (
    DRA_RECHECK_SECONDS,
    WARNING_REASONS,
    DeviceReport,
    PendingClaim,
    SliceDevice,
    assess_devices,
    claim_stacks,
    claim_template,
    require_dra,
)
from kunlun_operator.decide.health_gate import CONDITION_TYPE as CARD_HEALTH_REPORTED
from kunlun_operator.decide.health_gate import GatedPod, GateOutcome, health_reported_condition
from kunlun_operator.decide.image_pull import CONDITION_TYPE as RUNTIME_IMAGE_AVAILABLE
from kunlun_operator.decide.image_pull import ImagePull, runtime_image_condition
from kunlun_operator.decide.nodes import NodeFacts, NodeReport, assess_nodes, version_mismatches
from kunlun_operator.decide.replicas import CONDITION_TYPE as REPLICAS_HEALTHY
from kunlun_operator.decide.replicas import CardFault, ReplacementOutcome, replicas_condition
from kunlun_operator.decide.routing import CONDITION_TYPE as ROUTED
from kunlun_operator.decide.routing import (
    ROUTING_RECHECK_SECONDS,
    absent_routing_kinds,
    require_routing_apis,
    routed_condition,
    routing_objects,
)
from kunlun_operator.decide.status import (
    FAILED,
    PROGRESSING,
    READY,
    Condition,
    ConditionStatus,
    DeploymentFacts,
    bool_status,
    condition_status,
    decide_phase,
    desired_replicas,
    merge_conditions,
)
from kunlun_operator.errors import SpecError
from kunlun_operator.policy.admission_policy import STRICTEST, AdmissionPolicy, check_policy
from kunlun_operator.policy.matrix import Matrix, check_versions, select_image
from kunlun_operator.spec.operator_config import (
    DEFAULT_PICKER_IMAGES,
    DEFAULT_PREFLIGHT_HOST,
    PickerImages,
    PreflightHost,
)
from kunlun_operator.spec.service import ParsedSpec, ServiceRef
from kunlun_operator.spec.values import InferenceSpec

EventType = Literal["Normal", "Warning"]


@dataclass(frozen=True, slots=True)
class PodFacts:
    name: str
    node_name: str | None
    uid: str = ""
    fault: CardFault | None = None  # its card is unhealthy (``replicas.card_fault``)
    gate: GatedPod | None = None  # it carries the readiness gate (``health_gate.gated_pod``)
    pull: ImagePull | None = None  # its runtime image's pull state (``image_pull.image_pull``)
    #: it waits for the scheduler to allocate its claim (``allocation.pending_claim``)
    pending_claim: PendingClaim | None = None
    #: its runtime answers (containers ready, an IP): adapters can be loaded (``adapters.adapter_pod``)
    adapter_pod: AdapterPod | None = None


@dataclass(frozen=True, slots=True)
class ClusterFacts:
    """Everything the operator read from the cluster for one reconcile."""

    nodes: tuple[NodeFacts, ...]
    matrix: Matrix
    #: --default-runtime-image: only when no matrix entry certifying the versions names an image
    default_image: str = names.DEFAULT_RUNTIME_IMAGE
    monitoring_plurals: frozenset[str] = frozenset()  # served monitoring.coreos.com/v1 plurals
    #: The runtime workload's report: the Deployment, or the LeaderWorkerSet of a multi-node service.
    deployment: DeploymentFacts | None = None
    #: The cluster serves leaderworkerset.x-k8s.io/v1 (discovery) and the operator may use it.
    leaderworkerset_served: bool = False
    pods: tuple[PodFacts, ...] = ()
    pvc_exists: bool | None = None  # None: not a PVC source, or not looked up
    image_volumes: bool = False
    xpu_health_gate: bool = True  # --xpu-health-gate: the pods' readiness gate on card health
    preflight_host: PreflightHost = (
        DEFAULT_PREFLIGHT_HOST  # --preflight-kml-version-file, --preflight-xpu-smi
    )
    policy: AdmissionPolicy = STRICTEST  # the cluster admin's admission policy
    #: Replicas on failed cards: who waits, who was evicted in this pass, who could not be.
    replacements: ReplacementOutcome = field(default_factory=ReplacementOutcome)
    #: Readiness gates nobody reported on: who waits, whose gate the operator set.
    gates: GateOutcome = field(default_factory=GateOutcome)
    #: The cluster serves inference.networking.k8s.io/v1 InferencePools (discovery) and the
    #: operator may use them (``--inference-pool``); gateway.networking.k8s.io/v1 HTTPRoutes too.
    inference_pool_served: bool = False
    httproute_served: bool = False
    #: --endpoint-picker-image, --precise-endpoint-picker-image
    picker_images: PickerImages = DEFAULT_PICKER_IMAGES
    #: A routed service's Endpoint Picker Deployment (its report), InferencePool and HTTPRoute
    #: (None: absent, or no gateway named); the pool's and the route's status.parents carry the
    #: Gateway's verdicts.
    picker: DeploymentFacts | None = None
    pool: Mapping[str, Any] | None = None
    route: Mapping[str, Any] | None = None
    #: The operator may use Dynamic Resource Allocation (``--dra``) and the cluster serves
    #: resource.k8s.io/v1 (discovery); the devices our driver's ResourceSlices publish (read for
    #: ``dra`` services only; None: not read).
    dra_served: bool = False
    devices: tuple[SliceDevice, ...] | None = None
    #: The adapters on each ready pod after this pass's load/unload calls (``runtime.lora.runtimeUpdates``
    #: only; None: not synced).
    adapters: AdapterOutcome | None = None


@dataclass(frozen=True, slots=True)
class Event:
    type: EventType
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class Plan:
    apply: tuple[dict[str, Any], ...]  # desired objects, in apply order
    delete: tuple[names.Kind, ...]  # owned kinds that must not exist
    status: dict[str, Any]
    events: tuple[Event, ...] = field(default=())
    #: Per kind, field paths whose live value wins over the plan (owned by another controller).
    live_fields: Mapping[str, tuple[tuple[str, ...], ...]] = field(default_factory=dict)
    #: Reconcile again after this many seconds (a replica becomes due for replacement, or an
    #: eviction is retried); None: on the next event or resync.
    requeue_after_seconds: float | None = None
    #: Owned kinds named by their content: the service's objects of these kinds that ``apply``
    #: does not name are deleted (``names.PRUNED_KINDS``).
    prune: tuple[names.Kind, ...] = ()


def reconcile(
    ref: ServiceRef,
    spec: ParsedSpec,
    previous_status: Mapping[str, Any] | None,
    facts: ClusterFacts,
    *,
    now: str,
) -> Plan:
    """The plan for one KunlunInferenceService whose spec was parsed (``parse_spec_or_error``).
    Never raises on bad input: a bad spec is a plan."""
    previous = previous_status or {}
    if isinstance(spec, SpecError):
        return _failed_plan(ref, previous, spec, now)
    violation = check_policy(spec, facts.policy)
    if violation is not None:
        # Admitted under an older policy: stop serving it. The runtime pods go (they may mount a
        # host path or run an image the admin no longer allows); the rest is harmless and stays.
        return _failed_plan(ref, previous, violation, now, delete=(names.DEPLOYMENT, names.HPA))
    if spec.multi_node and (bad_name := leaderworkerset_name_error(ref.name)) is not None:
        return _failed_plan(ref, previous, bad_name, now)
    missing = require_leaderworkerset(spec, facts.leaderworkerset_served)
    if missing is not None:
        # Builds nothing; checked again soon, so installing LeaderWorkerSet needs no spec change.
        plan = _failed_plan(ref, previous, missing, now)
        return dataclasses.replace(plan, requeue_after_seconds=LEADERWORKERSET_RECHECK_SECONDS)
    missing = require_routing_apis(
        spec, inference_pool_served=facts.inference_pool_served, httproute_served=facts.httproute_served
    )
    if missing is not None:
        # Builds nothing; checked again soon, so installing the CRDs needs no spec change.
        plan = _failed_plan(ref, previous, missing, now)
        return dataclasses.replace(plan, requeue_after_seconds=ROUTING_RECHECK_SECONDS)
    missing = require_dra(spec, facts.dra_served)
    if missing is not None:
        plan = _failed_plan(ref, previous, missing, now)
        return dataclasses.replace(plan, requeue_after_seconds=DRA_RECHECK_SECONDS)
    image = spec.runtime.image or select_image(facts.matrix, spec.versions, facts.default_image)
    problems = [] if spec.versions.policy == "Off" else check_versions(facts.matrix, image, spec.versions)
    if problems and spec.versions.policy == "Strict":
        return _failed_plan(ref, previous, problems[0], now)

    desired = desired_replicas(spec, facts.deployment)
    objects, absent = desired_objects(ref, spec, facts, image, replicas=desired)
    report = (
        assess_devices(
            facts.devices or (),
            spec,
            claim_stacks(spec, facts.matrix, image),
            tuple(p.pending_claim for p in facts.pods if p.pending_claim is not None),
        )
        if spec.resources.dra
        else assess_nodes(facts.nodes, spec)
    )
    ready = facts.deployment.ready_replicas if facts.deployment else 0
    workload = names.LEADER_WORKER_SET if spec.multi_node else names.DEPLOYMENT
    phase, reason, message = decide_phase(
        facts.deployment,
        desired,
        num_compatible_nodes=len(report.compatible_node_names),
        locked=spec.versions.policy != "Off",
        workload=workload.kind,
    )
    conditions = [
        Condition("Ready", bool_status(phase == READY), reason, message),
        Condition("Progressing", bool_status(phase == PROGRESSING), reason, message),
        _versions_condition(spec, facts, problems),
        Condition("DevicesAvailable", _devices_status(report), report.reason, report.message),
        _model_condition(spec, facts, ready),
        replicas_condition(facts.replacements),
        health_reported_condition(facts.gates, gate=facts.xpu_health_gate),
        runtime_image_condition(
            (p.pull for p in facts.pods if p.pull is not None), image, from_matrix=spec.runtime.image is None
        ),
    ]
    routed = routed_condition(ref, spec, facts.picker, facts.pool, facts.route)
    if routed is not None:  # routed through an InferencePool only
        conditions.append(routed)
    adapters = adapters_condition(spec, facts.adapters, ready)
    if adapters is not None:  # LoRA on only
        conditions.append(adapters)
    status: dict[str, Any] = {
        "phase": phase,
        "replicas": facts.deployment.replicas if facts.deployment else 0,
        "readyReplicas": ready,
        "ready": f"{ready}/{desired}",
        "selector": names.selector_string(ref.name),
        "endpoint": endpoint_url(ref, spec),
        "observedGeneration": ref.generation,
        "compatibleNodes": len(report.compatible_node_names),
        "conditions": merge_conditions(
            conditions, previous.get("conditions") or [], now=now, generation=ref.generation
        ),
    }
    if facts.adapters is not None:
        status["adapters"] = adapters_status(facts.adapters)
    if previous.get("lastFailure"):
        status["lastFailure"] = previous["lastFailure"]
    status.update(_replacement_status(facts.replacements, previous, now))
    events = (
        *_transition_events(previous, status),
        *_reason_events(previous, status),
        *_replacement_events(facts.replacements, previous),
    )
    live = {workload.kind: (("spec", "replicas"),)} if spec.autoscaling.enabled else {}
    return Plan(
        apply=tuple(objects),
        delete=tuple(absent),
        status=status,
        events=events,
        live_fields=live,
        requeue_after_seconds=_earliest(
            facts.replacements.recheck_after_seconds,
            facts.gates.recheck_after_seconds,
            facts.adapters.recheck_after_seconds if facts.adapters is not None else None,
        ),
        prune=(names.RESOURCE_CLAIM_TEMPLATE,) if facts.dra_served else (),
    )


def _devices_status(report: NodeReport | DeviceReport) -> ConditionStatus:
    if isinstance(report, DeviceReport):
        return report.status
    return bool_status(bool(report.compatible_node_names))


def _earliest(*delays: float | None) -> float | None:
    """The soonest of the delays that are set; None when none is."""
    return min((d for d in delays if d is not None), default=None)


def _replacement_status(outcome: ReplacementOutcome, previous: Mapping[str, Any], now: str) -> dict[str, Any]:
    """``replicaReplacements`` (a running count) and ``lastReplacement``."""
    out: dict[str, Any] = {
        "replicaReplacements": int(previous.get("replicaReplacements") or 0) + len(outcome.evicted)
    }
    if outcome.evicted:
        last = outcome.evicted[-1]
        out["lastReplacement"] = {
            "pod": last.pod,
            "node": last.node or "unknown",
            "card": last.card,
            "reason": last.reason,
            "time": now,
        }
    elif previous.get("lastReplacement"):
        out["lastReplacement"] = previous["lastReplacement"]
    return out


def _replacement_events(outcome: ReplacementOutcome, previous: Mapping[str, Any]) -> tuple[Event, ...]:
    """One event when a card fault is first seen or the PDB starts blocking.

    The ``ReplacingReplica`` event of an eviction is not here: the controller posts it as soon as
    the API accepts the eviction, so a pass that fails afterwards (apply, status) cannot lose it.
    """
    events: list[Event] = []
    cond = replicas_condition(outcome)
    before: Mapping[str, Any] = next(
        (c for c in previous.get("conditions") or [] if c.get("type") == cond.type), {}
    )
    entered = before.get("reason") != cond.reason
    if entered and cond.reason in ("CardUnhealthy", "WaitingForDisruptionBudget"):
        events.append(Event("Warning", cond.reason, cond.message))
    return tuple(events)


def desired_objects(
    ref: ServiceRef, spec: InferenceSpec, facts: ClusterFacts, image: str, *, replicas: int
) -> tuple[list[dict[str, Any]], list[names.Kind]]:
    """The owned objects to apply (in order) and the owned kinds that must be absent; ``replicas``:
    the workload's (``status.desired_replicas``)."""
    path = model_path(spec, image_volumes=facts.image_volumes)
    configmap = build_configmap(ref, spec, path, image_volumes=facts.image_volumes)
    # A multi-node service's replicas are LeaderWorkerSet groups; switching either way removes the
    # other workload (a leftover LeaderWorkerSet only where the cluster serves the kind).
    build_workload = build_leaderworkerset if spec.multi_node else build_deployment
    template = claim_template(ref, spec, facts.matrix, image)  # before the pods that name it
    objects = [
        configmap,
        build_service(ref, spec),
        *([template] if template is not None else []),
        build_workload(
            ref,
            spec,
            image=image,
            config_hash=config_hash(configmap["data"]),
            image_volumes=facts.image_volumes,
            replicas=replicas,
            xpu_health_gate=facts.xpu_health_gate,
            preflight_host=facts.preflight_host,
            **({"claim_template": template["metadata"]["name"]} if template is not None else {}),
        ),
        build_pdb(ref, spec),
    ]
    absent: list[names.Kind] = []
    if spec.multi_node:
        absent.append(names.DEPLOYMENT)
    elif facts.leaderworkerset_served:
        absent.append(names.LEADER_WORKER_SET)
    if spec.autoscaling.enabled:
        objects.append(build_hpa(ref, spec))
    else:
        absent.append(names.HPA)
    for kind, wanted, build in (
        (names.SERVICE_MONITOR, spec.monitoring.service_monitor, build_servicemonitor),
        (names.PROMETHEUS_RULE, spec.monitoring.prometheus_rule, build_prometheusrule),
    ):
        if kind.plural not in facts.monitoring_plurals:
            continue  # the Prometheus Operator is not installed: skipped silently
        if wanted:
            objects.append(build(ref, spec))
        else:
            absent.append(kind)
    if facts.inference_pool_served:  # else a routed spec fails before (require_routing_apis)
        objects += routing_objects(ref, spec, images=facts.picker_images, image_volumes=facts.image_volumes)
    absent += absent_routing_kinds(
        spec, inference_pool_served=facts.inference_pool_served, httproute_served=facts.httproute_served
    )
    return objects, absent


def _versions_condition(spec: InferenceSpec, facts: ClusterFacts, problems: list[SpecError]) -> Condition:
    v = spec.versions
    if v.policy == "Off":
        return Condition(
            "VersionsCompatible", "Unknown", "PolicyOff", "versions are not checked (policy Off)"
        )
    if problems:
        text = "; ".join(str(p) for p in problems)
        return Condition("VersionsCompatible", "False", "UnsupportedVersions", text)
    locked = f"driver {v.driver}, firmware {v.firmware}, kml {v.kml}"
    if v.policy == "Strict":
        return Condition(
            "VersionsCompatible",
            "True",
            "VersionsLocked",
            f"pods require nodes with {locked} (node affinity + preflight)",
        )
    by_name = {n.name: n for n in facts.nodes}
    mismatched = []
    for pod in facts.pods:
        node = by_name.get(pod.node_name or "")
        if node is not None and version_mismatches(node, v):
            mismatched.append(f"{pod.name} on {node.name}: {', '.join(version_mismatches(node, v))}")
    if mismatched:
        text = "; ".join(sorted(mismatched))
        return Condition("VersionsCompatible", "False", "PodsOnMismatchedNodes", text)
    return Condition("VersionsCompatible", "True", "VersionsMatch", f"every scheduled pod runs on {locked}")


def _model_condition(spec: InferenceSpec, facts: ClusterFacts, ready: int) -> Condition:
    if ready > 0:
        return Condition(
            "ModelAvailable", "True", "ModelLoaded", f"{spec.model.name} is served by {ready} replica(s)"
        )
    source = spec.model.source
    if source.kind == "pvc" and facts.pvc_exists is False:
        return Condition(
            "ModelAvailable",
            "False",
            "PVCNotFound",
            f"PersistentVolumeClaim {source.claim_name} does not exist",
        )
    return Condition("ModelAvailable", "Unknown", "NotLoadedYet", "no replica has loaded the model yet")


def _failed_plan(
    ref: ServiceRef,
    previous: Mapping[str, Any],
    error: SpecError,
    now: str,
    *,
    delete: tuple[names.Kind, ...] = (),
) -> Plan:
    message = str(error)
    failure: dict[str, Any] = {"reason": error.reason, "message": message, "time": now}
    same = (previous.get("lastFailure") or {}).get("message") == message
    if same:
        failure["time"] = previous["lastFailure"].get("time", now)
    conditions = [
        Condition("Ready", "False", error.reason, message),
        Condition("Progressing", "False", error.reason, message),
        Condition(
            "VersionsCompatible",
            "False" if error.reason == "UnsupportedVersions" else "Unknown",
            error.reason,
            message,
        ),
        Condition("DevicesAvailable", "Unknown", error.reason, "not evaluated: the spec is invalid"),
        Condition("ModelAvailable", "Unknown", error.reason, "not evaluated: the spec is invalid"),
        Condition(REPLICAS_HEALTHY, "Unknown", error.reason, "not evaluated: the spec is invalid"),
        Condition(CARD_HEALTH_REPORTED, "Unknown", error.reason, "not evaluated: the spec is invalid"),
        Condition(RUNTIME_IMAGE_AVAILABLE, "Unknown", error.reason, "not evaluated: the spec is invalid"),
    ]
    status: dict[str, Any] = {
        "phase": FAILED,
        "observedGeneration": ref.generation,
        "selector": names.selector_string(ref.name),
        "lastFailure": failure,
        "conditions": merge_conditions(
            conditions, previous.get("conditions") or [], now=now, generation=ref.generation
        ),
    }
    for key in (
        "replicas",
        "readyReplicas",
        "ready",
        "endpoint",
        "compatibleNodes",
        "replicaReplacements",
        "lastReplacement",
    ):
        if key in previous:
            status[key] = previous[key]
    events = () if same else (Event("Warning", error.reason, message),)
    return Plan(apply=(), delete=delete, status=status, events=events)


#: (condition type, status) entered -> the event it posts: type and reason (None: the condition's).
_TRANSITIONS: Mapping[tuple[str, str], tuple[EventType, str | None]] = {
    ("Ready", "True"): ("Normal", "Ready"),
    ("DevicesAvailable", "False"): ("Warning", None),
    ("VersionsCompatible", "False"): ("Warning", None),
    ("ModelAvailable", "False"): ("Warning", None),
    (RUNTIME_IMAGE_AVAILABLE, "False"): ("Warning", None),
    (ROUTED, "True"): ("Normal", None),
    (ADAPTERS_READY, "False"): ("Warning", None),
}


def _reason_events(previous: Mapping[str, Any], status: Mapping[str, Any]) -> tuple[Event, ...]:
    """A Warning when a False condition turns to one of ``WARNING_REASONS`` (a claim the scheduler
    cannot allocate after no slice was published, say): no status change, so no transition event."""
    before = {c["type"]: c for c in previous.get("conditions") or []}
    events = []
    for cond in status["conditions"]:
        old = before.get(cond["type"])
        if (
            cond["status"] == "False"
            and cond["reason"] in WARNING_REASONS
            and old is not None
            and old.get("status") == "False"
            and old.get("reason") != cond["reason"]
        ):
            events.append(Event("Warning", cond["reason"], cond["message"]))
    return tuple(events)


def _transition_events(previous: Mapping[str, Any], status: Mapping[str, Any]) -> tuple[Event, ...]:
    """One event per condition that just entered a state a user would look for."""
    before = previous.get("conditions") or []
    events: list[Event] = []
    for cond in status["conditions"]:
        rule = _TRANSITIONS.get((cond["type"], cond["status"]))
        if rule is None or condition_status(before, cond["type"]) == cond["status"]:
            continue
        type_, reason = rule
        events.append(Event(type_, reason or cond["reason"], cond["message"]))
    return tuple(events)

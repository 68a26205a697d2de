"""One reconcile pass of one KunlunInferenceService: read facts, plan, apply, write status, post events.

Owns: the I/O around the pure ``reconcile`` (what is read, in which order things are written), the
cleanup on deletion, and the per-service lock that keeps a pass and a cleanup from overlapping.
Synchronous (the kopf shell runs it in a worker thread). Invariant: a pass interrupted anywhere
and started again converges to the same objects; it never writes what already matches.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kunlun_operator import names
from kunlun_operator.builders.adapters import adapter_mounts
from kunlun_operator.decide.adapters import (
    AdapterOutcome,
    adapter_pod,
)
from kunlun_operator.decide.allocation import SliceDevice, parse_slice_devices, pending_claim
from kunlun_operator.decide.health_gate import gated_pod
from kunlun_operator.decide.image_pull import image_pull
from kunlun_operator.decide.nodes import NodeFacts
from kunlun_operator.decide.reconcile import ClusterFacts, Plan, PodFacts, reconcile
from kunlun_operator.decide.replicas import (
    EVICTION_RETRY_SECONDS,
    CardFault,
    ReplacementOutcome,
    card_fault,
    parse_time,
    plan_replacements,
    replacement_message,
)
from kunlun_operator.decide.status import DeploymentFacts
from kunlun_operator.errors import ApiError, OwnershipError, SpecError
from kunlun_operator.policy.admission_policy import STRICTEST, AdmissionPolicy, check_policy
from kunlun_operator.policy.matrix import MATRIX_KEY, Matrix, load_default_matrix, merge_cards, parse_matrix
from kunlun_operator.shell.apply import (
    CREATED,
    DELETED,
    RESTORED,
    UNCHANGED,
    UPDATED,
    Change,
    apply_object,
    delete_object,
    removal_patch,
)
from kunlun_operator.shell.kube import POD, PVC, KubeClient
from kunlun_operator.shell.metrics import OperatorMetrics
from kunlun_operator.shell.pod_adapters import AdapterSyncer, read_api_key, unreachable
from kunlun_operator.shell.pod_gates import EventSink, GateOpener, service_reference
from kunlun_operator.spec.operator_config import (
    DEFAULT_PICKER_IMAGES,
    DEFAULT_PREFLIGHT_HOST,
    PickerImages,
    PreflightHost,
)
from kunlun_operator.spec.service import (
    ParsedService,
    ParsedSpec,
    ServiceRef,
    parse_service,
    parse_service_ref,
)
from kunlun_operator.spec.values import InferenceSpec

logger = logging.getLogger(__name__)

_CHANGE_EVENTS = {
    CREATED: ("Normal", "Created", "created {kind} {name}"),
    UPDATED: ("Normal", "Updated", "updated {kind} {name} to the new spec"),
    RESTORED: (
        "Warning",
        "DriftRestored",
        "{kind} {name} was changed or deleted outside the operator; restored",
    ),
    DELETED: ("Normal", "Deleted", "deleted {kind} {name}"),
}


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    default_image: str = names.DEFAULT_RUNTIME_IMAGE
    matrix_configmap: tuple[str, str] | None = None  # (namespace, name)
    image_volumes: bool = False
    xpu_health_gate: bool = True  # --[no-]xpu-health-gate
    policy: AdmissionPolicy = STRICTEST  # --admission-policy
    preflight_host: PreflightHost = (
        DEFAULT_PREFLIGHT_HOST  # --preflight-kml-version-file, --preflight-xpu-smi
    )
    #: --[no-]leaderworkerset: multi-node services may use LeaderWorkerSet where the cluster serves it
    leaderworkerset: bool = True
    #: --xpu-health-gate-grace-seconds: how long a ready pod waits for the device plugin's report
    #: before the operator sets its readiness gate (``health_gate``); 0: never
    health_gate_grace_seconds: float = 120.0
    #: --[no-]inference-pool: routed services may use InferencePools where the cluster serves them
    inference_pool: bool = True
    #: --endpoint-picker-image, --precise-endpoint-picker-image
    picker_images: PickerImages = DEFAULT_PICKER_IMAGES
    #: --dra: services may claim their cards through Dynamic Resource Allocation where the
    #: cluster serves resource.k8s.io/v1 (off: such services are refused; no rights on its API)
    dra: bool = False


class Controller:
    def __init__(
        self,
        client: KubeClient,
        config: ControllerConfig,
        metrics: OperatorMetrics,
        post_event: EventSink,
        clock: Callable[[], str] = utc_now,
        adapters: AdapterSyncer | None = None,
    ) -> None:
        self.client = client
        self.config = config
        self.metrics = metrics
        self.post_event = post_event
        self.clock = clock
        # The packaged matrix (no ConfigMap, or a malformed one) names the public registry: its
        # images move to the directory of --default-runtime-image, the cluster's own mirror.
        self.default_matrix = load_default_matrix().under_registry_of(config.default_image)
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self._phases: dict[tuple[str, str], str] = {}
        # Per service: pod uid -> when a fault without a time of its own was first seen, and the
        # uids whose eviction the API accepted (a stale listing must not evict them twice).
        self._first_seen: dict[tuple[str, str], dict[str, datetime.datetime]] = {}
        self._evicted: dict[tuple[str, str], set[str]] = {}
        self.gates = GateOpener(client, metrics, post_event, grace_seconds=config.health_gate_grace_seconds)
        self.adapters = adapters or AdapterSyncer()

    def lock(self, namespace: str, name: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault((namespace, name), threading.Lock())

    def load_matrix(self) -> Matrix:
        """The matrix ConfigMap (``--compatibility-configmap``), else the packaged default (also when
        the ConfigMap is absent or malformed; the latter is logged as an error)."""
        if self.config.matrix_configmap is None:
            return self.default_matrix
        namespace, name = self.config.matrix_configmap
        configmap = self.client.get(names.CONFIGMAP, namespace, name)
        text = ((configmap or {}).get("data") or {}).get(MATRIX_KEY)
        if text is None:
            return self.default_matrix
        try:
            return merge_cards(
                parse_matrix(text, source=f"ConfigMap {namespace}/{name}"), self.default_matrix
            )
        except ValueError as error:
            logger.error("%s; using the packaged compatibility matrix", error)
            return self.default_matrix

    def leaderworkerset_served(self) -> bool:
        """Whether multi-node services can be served: allowed (``--leaderworkerset``) and the
        cluster serves ``leaderworkersets`` in ``leaderworkerset.x-k8s.io/v1`` (discovery).

        Raises:
            ApiError: discovery failed (other than "not served").
        """
        if not self.config.leaderworkerset:
            return False
        return names.LEADER_WORKER_SET.plural in self.client.served_plurals(names.LWS_GROUP_VERSION)

    def routing_served(self) -> tuple[bool, bool]:
        """Whether routed services can be served: ``(InferencePool, HTTPRoute)``, each allowed
        (``--inference-pool``) and served by the cluster (discovery; HTTPRoute asked only where
        InferencePool is served).

        Raises:
            ApiError: discovery failed (other than "not served").
        """
        if not self.config.inference_pool:
            return False, False
        if names.INFERENCE_POOL.plural not in self.client.served_plurals(names.INFERENCE_GROUP_VERSION):
            return False, False
        return True, names.HTTP_ROUTE.plural in self.client.served_plurals(names.GATEWAY_GROUP_VERSION)

    def dra_served(self) -> bool:
        """Whether ``dra`` services can be served: allowed (``--dra``) and the cluster serves
        ``resourceclaimtemplates`` in ``resource.k8s.io/v1`` (discovery).

        Raises:
            ApiError: discovery failed (other than "not served").
        """
        if not self.config.dra:
            return False
        return names.RESOURCE_CLAIM_TEMPLATE.plural in self.client.served_plurals(names.DRA_GROUP_VERSION)

    def read_devices(self, spec: InferenceSpec | None, dra_served: bool) -> tuple[SliceDevice, ...] | None:
        """The devices our driver's ResourceSlices publish, for a ``dra`` service (None otherwise)."""
        if spec is None or not spec.resources.dra or not dra_served:
            return None
        ours = f"spec.driver={names.DRA_DRIVER}"  # the API server indexes slices by driver
        return parse_slice_devices(self.client.list(names.RESOURCE_SLICE, None, field_selector=ours))

    def read_routing(
        self, ref: ServiceRef, spec: InferenceSpec | None, pool_served: bool, route_served: bool
    ) -> tuple[DeploymentFacts | None, dict[str, Any] | None, dict[str, Any] | None]:
        """A routed service's picker Deployment (its report), InferencePool and, with a gateway
        named, HTTPRoute (whose status carries the Gateway's verdict on the route); None where
        absent or where the service is not routed through a pool (or route) the cluster serves."""
        if spec is None or not spec.routing.inference_pool or not pool_served:
            return None, None, None
        picker = self.client.get(
            names.PICKER_DEPLOYMENT, ref.namespace, names.owned_name(ref.name, names.PICKER_DEPLOYMENT)
        )
        pool = self.client.get(
            names.INFERENCE_POOL, ref.namespace, names.owned_name(ref.name, names.INFERENCE_POOL)
        )
        route = None
        if spec.routing.gateway is not None and route_served:
            route = self.client.get(
                names.HTTP_ROUTE, ref.namespace, names.owned_name(ref.name, names.HTTP_ROUTE)
            )
        return (DeploymentFacts.from_object(picker) if picker else None), pool, route

    def read_facts(self, ref: ServiceRef, spec: ParsedSpec, nodes: Iterable[NodeFacts]) -> ClusterFacts:
        """What the reconcile of the service ``ref`` needs from the cluster. The parsed ``spec``
        says which workload kind to read and which claim to look up; an invalid one gets the
        Deployment's report and no claim lookup (its plan is Failed, whatever they say)."""
        lws_served = self.leaderworkerset_served()
        workload: DeploymentFacts | None = None
        parsed = spec if isinstance(spec, InferenceSpec) else None
        if parsed is not None and parsed.multi_node:
            if lws_served:
                lws = self.client.get(
                    names.LEADER_WORKER_SET,
                    ref.namespace,
                    names.owned_name(ref.name, names.LEADER_WORKER_SET),
                )
                workload = DeploymentFacts.from_leaderworkerset(lws) if lws else None
        else:
            deployment = self.client.get(names.DEPLOYMENT, ref.namespace, ref.name)
            workload = DeploymentFacts.from_object(deployment) if deployment else None
        pool_served, route_served = self.routing_served()
        picker, pool, route = self.read_routing(ref, parsed, pool_served, route_served)
        dra_served = self.dra_served()
        claim = None if parsed is None else parsed.model.source.claim_name  # set for a pvc source only
        pvc_exists = None if claim is None else self.client.get(PVC, ref.namespace, claim) is not None
        # The pods: where they run (Warn policy) and whether their cards are healthy.
        selector = names.selector_labels(ref.name)
        items = self.client.list(POD, ref.namespace, label_selector=names.selector_string(ref.name))
        pods = tuple(
            PodFacts(
                p["metadata"]["name"],
                (p.get("spec") or {}).get("nodeName"),
                uid=p["metadata"].get("uid") or p["metadata"]["name"],
                fault=card_fault(p),
                gate=gated_pod(p),
                pull=image_pull(p),
                pending_claim=pending_claim(p),
                adapter_pod=adapter_pod(p),
            )
            for p in items  # filtered here too: not every API honours labelSelector
            if all(((p["metadata"].get("labels") or {}).get(k) == v) for k, v in selector.items())
        )
        return ClusterFacts(
            nodes=tuple(nodes),
            matrix=self.load_matrix(),
            default_image=self.config.default_image,
            monitoring_plurals=self.client.served_plurals(names.MONITORING_GROUP_VERSION),
            deployment=workload,
            leaderworkerset_served=lws_served,
            pods=pods,
            pvc_exists=pvc_exists,
            image_volumes=self.config.image_volumes,
            xpu_health_gate=self.config.xpu_health_gate,
            policy=self.config.policy,
            preflight_host=self.config.preflight_host,
            inference_pool_served=pool_served,
            httproute_served=route_served,
            picker_images=self.config.picker_images,
            picker=picker,
            pool=pool,
            route=route,
            dra_served=dra_served,
            devices=self.read_devices(parsed, dra_served),
        )

    def reconcile(self, body: Mapping[str, Any], nodes: Iterable[NodeFacts]) -> Plan:
        """One full pass for the service ``body``.

        Raises:
            ApiError: an API call failed; the caller retries the retryable ones with backoff.
        """
        service = parse_service(body)
        ref = service.ref
        started = time.monotonic()
        with self.lock(ref.namespace, ref.name):
            try:
                plan = self._reconcile_locked(service, nodes)
            except ApiError as error:
                self.metrics.reconcile_total.labels(result="retry" if error.retryable else "error").inc()
                self._record_failure(ref, "ApiError", str(error))
                raise
            finally:
                self.metrics.reconcile_duration.observe(time.monotonic() - started)
        self.metrics.reconcile_total.labels(
            result="invalid" if plan.status["phase"] == "Failed" else "success"
        ).inc()
        self._phases[(ref.namespace, ref.name)] = plan.status["phase"]
        self.metrics.set_phases(self._phases)
        return plan

    def _reconcile_locked(self, service: ParsedService, nodes: Iterable[NodeFacts]) -> Plan:
        ref, spec, previous = service.ref, service.spec, service.status
        now = self.clock()
        facts = self.read_facts(ref, spec, nodes)
        facts = dataclasses.replace(
            facts,
            replacements=self.replace_replicas(ref, spec, facts.pods, now),
            gates=self.gates.open_gates(ref, (p.gate for p in facts.pods if p.gate), now),
            adapters=self.sync_adapters(ref, spec, facts),
        )
        plan = reconcile(ref, spec, previous, facts, now=now)
        existed_before = service.reconciled_this_generation
        changes: list[Change] = []  # reported one by one: a pass failing half-way still tells what it did
        try:
            for obj in plan.apply:
                live = plan.live_fields.get(obj["kind"], ())
                change = apply_object(
                    self.client, obj, owner_uid=ref.uid, existed_before=existed_before, live_fields=live
                )
                changes.append(self._report(ref, change))
        except OwnershipError as error:
            self._record_failure(ref, "NameConflict", str(error))
            self.post_event(service_reference(ref), "Warning", "NameConflict", str(error))
            raise ApiError(409, "NameConflict", str(error), call="apply") from None
        for kind in plan.delete:
            name = names.owned_name(ref.name, kind)
            deleted = delete_object(
                self.client, kind, ref.namespace, name, owner_name=ref.name, owner_uid=ref.uid
            )
            if deleted is not None:
                changes.append(self._report(ref, deleted))
        keep = {(o["kind"], o["metadata"]["name"]) for o in plan.apply}
        for kind in plan.prune:
            changes += self._prune(ref, kind, keep)
        if plan.status != previous:
            self.client.patch(
                names.KIS,
                ref.namespace,
                ref.name,
                {"status": removal_patch(plan.status, previous)},
                subresource="status",
            )
        for event in plan.events:
            self.post_event(service_reference(ref), event.type, event.reason, event.message)
        logger.info(
            "reconciled %s/%s generation %d: phase %s, %s",
            ref.namespace,
            ref.name,
            ref.generation,
            plan.status["phase"],
            ", ".join(f"{c.kind} {c.action}" for c in changes if c.action != UNCHANGED) or "no changes",
        )
        return plan

    def sync_adapters(self, ref: ServiceRef, spec: ParsedSpec, facts: ClusterFacts) -> AdapterOutcome | None:
        """Load and unload adapters on the service's ready pods (``runtime.lora.runtimeUpdates``
        only, and never for a spec the admission policy refuses); None: nothing synced."""
        if (
            not isinstance(spec, InferenceSpec)
            or spec.runtime.lora is None
            or not spec.runtime.lora.runtime_updates
        ):
            return None
        if check_policy(spec, self.config.policy) is not None:
            return None  # its plan is Failed; its sources are not to be read
        pods = [p.adapter_pod for p in facts.pods if p.adapter_pod is not None]
        desired = adapter_mounts(spec, image_volumes=self.config.image_volumes)
        where = f"{ref.namespace}/{ref.name}"
        try:
            api_key = read_api_key(self.client, ref.namespace, spec.api_key_secret)
        except ApiError as error:
            return unreachable(pods, desired, str(error))
        return self.adapters.sync(where, desired, pods, api_key)

    def replace_replicas(
        self, ref: ServiceRef, spec: ParsedSpec, pods: Iterable[PodFacts], now: str
    ) -> ReplacementOutcome:
        """Evict the replicas whose card has been unhealthy for ``spec.faultTolerance.replaceAfter``.

        Evictions go through the Eviction API, so the PodDisruptionBudget decides: a 429 (no
        budget left) leaves the pod in place and the pass asks again after
        ``EVICTION_RETRY_SECONDS``. Each accepted eviction gets its ``ReplacingReplica`` event on
        the service at once (the rest of the pass may still fail). An invalid spec replaces nothing
        (its phase is Failed anyway).
        """
        if isinstance(spec, SpecError):
            return ReplacementOutcome()
        replace_after = spec.fault_tolerance.replace_after_seconds
        key = (ref.namespace, ref.name)
        current = parse_time(now) or datetime.datetime.now(datetime.UTC)
        pods = tuple(pods)
        faults = [p.fault for p in pods if p.fault is not None]
        first_seen = self._first_seen.setdefault(key, {})
        for uid in set(first_seen) - {f.uid for f in faults}:
            del first_seen[uid]  # healthy again (or gone): a new fault starts a new wait
        for fault in faults:  # dated ones too: a node agent's restart may date its fault anew
            first_seen.setdefault(fault.uid, current)
        evicted = self._evicted.setdefault(key, set())
        evicted &= {p.uid for p in pods}  # forget pods that are gone
        plan = plan_replacements(
            faults,
            now=current,
            replace_after_seconds=replace_after,
            evicted_uids=frozenset(evicted),
            first_seen=first_seen,
        )
        done: list[CardFault] = []
        blocked: list[CardFault] = []
        failed: list[tuple[CardFault, str]] = []
        for fault in plan.evict:
            try:
                self.client.evict(ref.namespace, fault.pod, uid=fault.uid)
            except ApiError as error:
                if error.status == 429:
                    blocked.append(fault)
                    logger.info(
                        "eviction of %s of %s/%s refused: no disruption budget left; retry in %gs",
                        fault.describe(),
                        ref.namespace,
                        ref.name,
                        EVICTION_RETRY_SECONDS,
                    )
                elif error.status != 404:  # 404: the pod is already gone
                    failed.append((fault, f"{error.status} {error.reason}"))
                    logger.warning("eviction of %s of %s/%s failed: %s", fault.describe(), *key, error)
                continue
            evicted.add(fault.uid)
            done.append(fault)
            self.post_event(
                service_reference(ref),
                "Warning",
                "ReplacingReplica",
                replacement_message(fault, replace_after),
            )
            self.metrics.replica_replacements.labels(reason=fault.reason).inc()
            logger.warning(
                "evicted %s of %s/%s: card unhealthy for %gs or more (%s)",
                fault.describe(),
                ref.namespace,
                ref.name,
                replace_after,
                fault.reason,
            )
        recheck = plan.recheck_after_seconds
        if blocked or failed:
            recheck = min(recheck or EVICTION_RETRY_SECONDS, EVICTION_RETRY_SECONDS)
        return ReplacementOutcome(
            waiting=plan.waiting,
            in_flight=plan.in_flight,
            evicted=tuple(done),
            blocked=tuple(blocked),
            failed=tuple(failed),
            replace_after_seconds=replace_after,
            recheck_after_seconds=recheck,
        )

    def reconcile_key(self, namespace: str, name: str, nodes: Iterable[NodeFacts]) -> Plan | None:
        """Reconcile the service by name (fresh read); None when it is gone or being deleted."""
        body = self.client.get(names.KIS, namespace, name)
        if body is None or parse_service_ref(body).deleting:
            return None
        return self.reconcile(body, nodes)

    def cleanup(self, body: Mapping[str, Any]) -> list[Change]:
        """Delete every object the service owns (the finalizer's work on deletion)."""
        ref = parse_service_ref(body)
        changes: list[Change] = []
        with self.lock(ref.namespace, ref.name):
            served = self.client.served_plurals(names.MONITORING_GROUP_VERSION)
            lws_served = self.leaderworkerset_served()
            pool_served, route_served = self.routing_served()
            for kind in reversed(names.OWNED_KINDS):
                if kind in names.MONITORING_KINDS and kind.plural not in served:
                    continue
                if kind == names.LEADER_WORKER_SET and not lws_served:
                    continue
                if kind in names.ROUTING_KINDS and not pool_served:
                    continue  # no rights on them without --inference-pool (nor anything built)
                if kind == names.HTTP_ROUTE and not route_served:
                    continue
                if kind in names.PRUNED_KINDS:
                    if self.config.dra:  # no rights on claim templates without --dra
                        changes += self._prune(ref, kind, set())
                    continue
                name = names.owned_name(ref.name, kind)
                change = delete_object(
                    self.client, kind, ref.namespace, name, owner_name=ref.name, owner_uid=ref.uid
                )
                if change is not None:
                    changes.append(self._report(ref, change))
        self._phases.pop((ref.namespace, ref.name), None)
        self._first_seen.pop((ref.namespace, ref.name), None)
        self._evicted.pop((ref.namespace, ref.name), None)
        self.gates.forget(ref.namespace, ref.name)
        self.metrics.set_phases(self._phases)
        logger.info(
            "cleaned up %s/%s: %s",
            ref.namespace,
            ref.name,
            ", ".join(f"{c.kind} {c.action}" for c in changes) or "nothing to delete",
        )
        return changes

    def _prune(self, ref: ServiceRef, kind: names.Kind, keep: set[tuple[str, str]]) -> list[Change]:
        """Delete the service's objects of ``kind`` (found by its labels) that ``keep`` does not name."""
        changes = []
        for obj in self.client.list(kind, ref.namespace, label_selector=names.selector_string(ref.name)):
            name = obj["metadata"]["name"]
            if (kind.kind, name) in keep:
                continue
            change = delete_object(
                self.client, kind, ref.namespace, name, owner_name=ref.name, owner_uid=ref.uid
            )
            if change is not None:
                changes.append(self._report(ref, change))
        return changes

    def _report(self, ref: ServiceRef, change: Change) -> Change:
        """Count ``change`` and post its event on the service ``ref`` (unchanged objects are neither)."""
        if change.action in _CHANGE_EVENTS:
            self.metrics.object_changes.labels(kind=change.kind, action=change.action).inc()
            type_, reason, text = _CHANGE_EVENTS[change.action]
            self.post_event(
                service_reference(ref), type_, reason, text.format(kind=change.kind, name=change.name)
            )
        return change

    def _record_failure(self, ref: ServiceRef, reason: str, message: str) -> None:
        """Best effort: put the failure in ``status.lastFailure`` (the API may be failing too)."""
        try:
            self.client.patch(
                names.KIS,
                ref.namespace,
                ref.name,
                {"status": {"lastFailure": {"reason": reason, "message": message, "time": self.clock()}}},
                subresource="status",
            )
        except ApiError as error:
            logger.warning("could not record the failure of %s/%s: %s", ref.namespace, ref.name, error)

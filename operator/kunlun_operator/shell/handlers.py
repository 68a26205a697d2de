"""The kopf shell: which events wake which service, the per-service reconcile loop, admission.

Owns: kopf registrations and settings only; the work is in ``Controller`` (one reconcile pass) and
``admission`` (the webhook's verdict). Each KunlunInferenceService gets one daemon, a level-
triggered loop: it reconciles, then sleeps until woken (its spec changed, an owned object or a
Kunlun node changed, or the card health, readiness-gate facts or image pull of one of its pods) or
until the resync period passes, or until a replica on a failed card becomes due for replacement or
a pod's readiness gate for opening; a failed pass is retried with doubling delays. So one service
never has two passes at once, and no trigger is lost while a pass runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import kopf

from kunlun_operator import names
from kunlun_operator.decide import admission
from kunlun_operator.decide.allocation import pending_claim
from kunlun_operator.decide.health_gate import gated_pod
from kunlun_operator.decide.image_pull import image_pull
from kunlun_operator.decide.nodes import NodeFacts
from kunlun_operator.decide.replicas import card_fault
from kunlun_operator.errors import ApiError
from kunlun_operator.shell.controller import Controller
from kunlun_operator.shell.kube import POD
from kunlun_operator.spec.service import parse_service_ref, parse_spec_or_error

KIS = (names.GROUP, names.VERSION, names.PLURAL)
WATCHED_OWNED_KINDS = (names.CONFIGMAP, names.SERVICE, names.DEPLOYMENT, names.PDB, names.HPA)
MANAGED = {names.LABEL_MANAGED_BY: names.MANAGER}
log = logging.getLogger(__name__)
STOP_POLL_SECONDS = 0.25  # how often a sleeping loop checks kopf's stop flag
#: kopf types ``namespace`` as optional (for cluster-scoped kinds); every kind with a namespaced
#: handler here (the service and what it owns) is namespaced, so kopf always passes one.
NAMESPACED = "a namespaced object without a namespace"


@dataclass(frozen=True, slots=True)
class LoopConfig:
    resync_seconds: float = 300.0
    retry_delay_seconds: float = 2.0
    retry_max_seconds: float = 60.0
    watch_timeout_seconds: float | None = 300.0
    peering_lifetime_seconds: int = 60
    webhook: kopf.WebhookServer | None = None

    def retry_delay(self, attempt: int) -> float:
        return min(self.retry_max_seconds, self.retry_delay_seconds * 2.0 ** (attempt - 1))


class Wakers:
    """One asyncio.Event per service: set means "reconcile me again"."""

    def __init__(self) -> None:
        self._events: dict[tuple[str, str], asyncio.Event] = {}

    def get(self, namespace: str, name: str) -> asyncio.Event:
        return self._events.setdefault((namespace, name), asyncio.Event())

    def wake(self, namespace: str, name: str) -> None:
        self.get(namespace, name).set()

    def wake_all(self) -> None:
        for event in self._events.values():
            event.set()

    def forget(self, namespace: str, name: str) -> None:
        self._events.pop((namespace, name), None)


def node_facts(index: Mapping[str, Iterable[NodeFacts]]) -> tuple[NodeFacts, ...]:
    return tuple(fact for store in index.values() for fact in store)


def group_version(kind: names.Kind) -> tuple[str, str]:
    """``("apps", "v1")`` for ``apps/v1``; the core group is ``""``."""
    group, _, version = kind.api_version.rpartition("/")
    return group, version


def _node_fingerprint(labels: Mapping[str, str], spec: Mapping[str, Any]) -> tuple[Any, ...]:
    """What of a node the services depend on: its labels (versions, product, count, and whatever a
    ``scheduling.nodeSelector`` names) and whether it is schedulable. Status heartbeats are not."""
    return tuple(sorted(labels.items())), bool(spec.get("unschedulable"))


def _pod_fingerprint(pod: Mapping[str, Any]) -> tuple[Any, ...]:
    """What of a runtime pod its service depends on: its node, whether it is terminating, its card
    health (``replicas.card_fault``), its readiness gate's facts (containers ready, who reported:
    ``health_gate.gated_pod``) and whether its runtime image pulls (``image_pull``); container
    restarts, probe results and kubelet's back-off messages are not; a claim the scheduler cannot
    allocate (``allocation.pending_claim``) is."""
    fault = card_fault(pod)
    gate = gated_pod(pod)
    pull = image_pull(pod)
    claim = pending_claim(pod)
    meta = pod.get("metadata") or {}
    health = None if fault is None else (fault.card, fault.reason, fault.since)
    gate_facts = None if gate is None else (gate.containers_ready, gate.health)
    return (
        (pod.get("spec") or {}).get("nodeName"),
        bool(meta.get("deletionTimestamp")),
        health,
        gate_facts,
        None if pull is None else pull.state,
        None if claim is None else (claim.claim, claim.message),
    )


async def _sleep_until_woken(wake: asyncio.Event, stopped: kopf.DaemonStopped, seconds: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not stopped and not wake.is_set():
        remaining = deadline - loop.time()
        if remaining <= 0:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), min(remaining, STOP_POLL_SECONDS))


def post_event(body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    # kopf.event takes any mapping with apiVersion, kind and metadata (it walks plain dicts), but
    # its annotation names only its own Body view.
    kopf.event(dict(body), type=type_, reason=reason, message=message[:1024])  # type: ignore[arg-type]


def build_registry(controller: Controller, config: LoopConfig) -> kopf.OperatorRegistry:
    """A kopf registry with every handler of the operator, bound to ``controller``."""
    registry = kopf.OperatorRegistry()
    wakers = Wakers()
    generations: dict[tuple[str, str], Any] = {}
    node_prints: dict[str, tuple[Any, ...]] = {}
    pod_prints: dict[tuple[str, str], tuple[Any, ...]] = {}
    # LeaderWorkerSets only where the operator may use them (the chart grants no rights on them
    # otherwise); kopf watches them once the cluster serves the kind.
    watched_owned_kinds = WATCHED_OWNED_KINDS + (
        (names.LEADER_WORKER_SET,) if controller.config.leaderworkerset else ()
    )
    # InferencePools likewise (a Gateway's verdict in their status changes the Routed condition);
    # the picker's Deployment, Service and ConfigMap are in the plurals watched above.
    watched_owned_kinds += (names.INFERENCE_POOL,) if controller.config.inference_pool else ()

    @kopf.on.startup(registry=registry, id="configure")
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.persistence.finalizer = names.FINALIZER
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=names.GROUP, key="last-handled-configuration"
        )
        settings.peering.lifetime = config.peering_lifetime_seconds
        settings.posting.reporting_component = names.MANAGER
        settings.posting.level = logging.WARNING  # our own events carry the decisions
        settings.watching.server_timeout = config.watch_timeout_seconds
        settings.execution.max_workers = 8
        settings.admission.server = config.webhook
        # Only our own objects, filtered by the API server. The runtime pods carry the managed-by
        # label from the Deployment's template: a change of their card health wakes their service.
        for kind in (*watched_owned_kinds, POD):
            group, version = group_version(kind)
            settings.watching.label_selectors[group, version, kind.plural] = (
                f"{names.LABEL_MANAGED_BY}={names.MANAGER}"
            )

    @kopf.on.login(registry=registry, id="login")
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # The same credentials as the controller's client: in-cluster, else KUBECONFIG.
        return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)

    @kopf.index("", "v1", "nodes", registry=registry, id="kunlun_nodes")
    def kunlun_nodes(
        name: str, labels: Mapping[str, str], spec: Mapping[str, Any], **_: Any
    ) -> dict[str, NodeFacts]:
        return {name: NodeFacts(name, dict(labels), bool(spec.get("unschedulable")))}

    @kopf.daemon(
        *KIS, registry=registry, id="service_loop", cancellation_backoff=1.0, cancellation_timeout=10
    )
    async def service_loop(
        namespace: str | None,
        name: str,
        stopped: kopf.DaemonStopped,
        **kwargs: Any,
    ) -> None:
        assert namespace is not None, NAMESPACED
        # kopf passes every index by its id; DaemonFn has no parameter to name this one by.
        nodes_index: kopf.Index[str, NodeFacts] = kwargs["kunlun_nodes"]
        wake = wakers.get(namespace, name)
        attempt = 0
        while not stopped:
            wake.clear()
            try:
                plan = await asyncio.to_thread(
                    controller.reconcile_key, namespace, name, node_facts(nodes_index)
                )
                attempt, delay = 0, config.resync_seconds
                if plan is not None and plan.requeue_after_seconds is not None:
                    # a replica on a failed card becomes due, or an eviction is retried
                    delay = min(delay, max(plan.requeue_after_seconds, STOP_POLL_SECONDS))
            except ApiError as error:
                attempt += 1
                delay = config.retry_delay(attempt)
                log.warning(
                    "reconcile of %s/%s failed (%s); retry %d in %.1fs",
                    namespace,
                    name,
                    error,
                    attempt,
                    delay,
                )
            except Exception:  # a bug must not stop the loop: log it and retry with backoff
                attempt += 1
                delay = config.retry_delay(attempt)
                log.exception(
                    "reconcile of %s/%s crashed; retry %d in %.1fs", namespace, name, attempt, delay
                )
            await _sleep_until_woken(wake, stopped, delay)
        wakers.forget(namespace, name)

    @kopf.on.event(*KIS, registry=registry, id="service_event")
    async def on_service_event(
        type: str | None, body: kopf.Body, namespace: str | None, name: str, **_: Any
    ) -> None:
        assert namespace is not None, NAMESPACED
        ref = parse_service_ref(body)
        generation = (ref.generation, ref.deleting)
        if type is not None and generations.get((namespace, name)) != generation:
            generations[(namespace, name)] = generation  # status writes do not wake the loop
            wakers.wake(namespace, name)
        if type == "DELETED":
            generations.pop((namespace, name), None)

    for kind in watched_owned_kinds:
        group, version = group_version(kind)

        @kopf.on.event(
            group, version, kind.plural, labels=MANAGED, registry=registry, id=f"owned-{kind.plural}"
        )
        async def on_owned_event(
            type: str | None, namespace: str | None, labels: Mapping[str, str], **_: Any
        ) -> None:
            assert namespace is not None, NAMESPACED
            if type is not None and names.LABEL_INSTANCE in labels:
                wakers.wake(namespace, labels[names.LABEL_INSTANCE])

    @kopf.on.event("", "v1", POD.plural, labels=MANAGED, registry=registry, id="pod_event")
    async def on_pod_event(
        type: str | None,
        body: kopf.Body,
        namespace: str | None,
        name: str,
        labels: Mapping[str, str],
        **_: Any,
    ) -> None:
        # Only what the service depends on wakes it (probe results reach it via the Deployment).
        assert namespace is not None, NAMESPACED
        before = pod_prints.pop((namespace, name), None)
        fingerprint = () if type == "DELETED" else _pod_fingerprint(body)
        if type != "DELETED":
            pod_prints[(namespace, name)] = fingerprint
        if type is not None and before != fingerprint and names.LABEL_INSTANCE in labels:
            wakers.wake(namespace, labels[names.LABEL_INSTANCE])

    @kopf.on.event("", "v1", "nodes", registry=registry, id="node_event")
    async def on_node_event(
        type: str | None,
        name: str,
        labels: Mapping[str, str],
        spec: Mapping[str, Any],
        **_: Any,
    ) -> None:
        fingerprint = () if type == "DELETED" else _node_fingerprint(labels, spec)
        before = node_prints.get(name)
        node_prints[name] = fingerprint
        if type is not None and before != fingerprint:
            log.info("node %s changed (labels or schedulability); re-checking every service", name)
            wakers.wake_all()

    @kopf.on.delete(*KIS, registry=registry, id="cleanup")
    def on_service_delete(body: kopf.Body, retry: int, **_: Any) -> None:
        try:
            controller.cleanup(dict(body))
        except ApiError as error:
            if error.retryable:
                raise kopf.TemporaryError(str(error), delay=config.retry_delay(retry + 1)) from error
            raise kopf.PermanentError(str(error)) from error

    if config.webhook is not None:

        @kopf.on.validate(*KIS, id="validate-kis", registry=registry)
        def validate_kis(spec: Mapping[str, Any], name: str | None, warnings: list[str], **_: Any) -> None:
            try:
                matrix = controller.load_matrix()
            except ApiError as error:  # do not block admission on a flaky read: use the packaged copy
                matrix = controller.default_matrix
                warnings.append(f"compatibility matrix not readable ({error}); the packaged matrix was used")
            try:
                lws_served = controller.leaderworkerset_served()
            except ApiError as error:  # do not deny on a flaky discovery: reconcile reports it
                lws_served = True
                warnings.append(f"LeaderWorkerSet discovery failed ({error}); multi-node not checked")
            try:
                pool_served, route_served = controller.routing_served()
            except ApiError as error:  # likewise: the reconcile reports a missing API
                pool_served = route_served = True
                warnings.append(f"InferencePool/HTTPRoute discovery failed ({error}); routing not checked")
            try:
                dra_served = controller.dra_served()
            except ApiError as error:  # likewise: the reconcile reports a missing API
                dra_served = controller.config.dra
                warnings.append(
                    f"{names.DRA_GROUP_VERSION} discovery failed ({error}); allocation not checked"
                )
            verdict = admission.review(
                parse_spec_or_error(dict(spec)),
                matrix,
                controller.config.default_image,
                controller.config.policy,
                leaderworkerset_served=lws_served,
                inference_pool_served=pool_served,
                httproute_served=route_served,
                dra_served=dra_served,
                name=name,
            )
            warnings.extend(verdict.warnings)
            result = "denied" if not verdict.allowed else "warned" if verdict.warnings else "allowed"
            controller.metrics.admission_reviews.labels(result=result).inc()
            if verdict.denial is not None:
                raise kopf.AdmissionError(str(verdict.denial), code=422)

    return registry

"""One reconcile pass of one KunlunInferenceService: read facts, plan, apply, write status, post events.

Owns: the I/O around the pure ``reconcile`` (what is read, in which order things are written), the
cleanup on deletion, and the per-service lock that keeps a pass and a cleanup from overlapping.
Synchronous (the kopf shell runs it in a worker thread). Invariant: a pass interrupted anywhere
and started again converges to the same objects; it never writes what already matches.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kunlun_operator import names
from kunlun_operator.apply import (
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
from kunlun_operator.errors import ApiError, OwnershipError
from kunlun_operator.kube import POD, PVC, KubeClient
from kunlun_operator.matrix import MATRIX_KEY, Matrix, load_default_matrix, merge_cards, parse_matrix
from kunlun_operator.metrics import OperatorMetrics
from kunlun_operator.nodes import NodeFacts
from kunlun_operator.policy import STRICTEST, AdmissionPolicy
from kunlun_operator.reconcile import ClusterFacts, Plan, PodFacts, reconcile
from kunlun_operator.spec import ServiceRef, parse_service_ref
from kunlun_operator.status import DeploymentFacts

logger = logging.getLogger(__name__)

#: Posts a Kubernetes Event about ``body``: (body, type, reason, message).
EventSink = Callable[[Mapping[str, Any], str, str, str], None]
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
    policy: AdmissionPolicy = STRICTEST  # --admission-policy


class Controller:
    def __init__(
        self,
        client: KubeClient,
        config: ControllerConfig,
        metrics: OperatorMetrics,
        post_event: EventSink,
        clock: Callable[[], str] = utc_now,
    ) -> None:
        self.client = client
        self.config = config
        self.metrics = metrics
        self.post_event = post_event
        self.clock = clock
        self.default_matrix = load_default_matrix()
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self._phases: dict[tuple[str, str], str] = {}

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

    def read_facts(
        self, ref: ServiceRef, spec: Mapping[str, Any], nodes: Iterable[NodeFacts]
    ) -> ClusterFacts:
        deployment = self.client.get(names.DEPLOYMENT, ref.namespace, ref.name)
        source = (spec.get("model") or {}).get("source") or {}
        pvc_exists = None
        if isinstance(source.get("pvc"), Mapping) and source["pvc"].get("claimName"):
            pvc_exists = self.client.get(PVC, ref.namespace, source["pvc"]["claimName"]) is not None
        pods: tuple[PodFacts, ...] = ()
        if (spec.get("versions") or {}).get("policy") == "Warn":
            selector = names.selector_labels(ref.name)
            items = self.client.list(POD, ref.namespace, label_selector=names.selector_string(ref.name))
            pods = tuple(
                PodFacts(p["metadata"]["name"], (p.get("spec") or {}).get("nodeName"))
                for p in items  # filtered here too: not every API honours labelSelector
                if all(((p["metadata"].get("labels") or {}).get(k) == v) for k, v in selector.items())
            )
        return ClusterFacts(
            nodes=tuple(nodes),
            matrix=self.load_matrix(),
            default_image=self.config.default_image,
            monitoring_plurals=self.client.served_plurals(names.MONITORING_GROUP_VERSION),
            deployment=DeploymentFacts.from_object(deployment) if deployment else None,
            pods=pods,
            pvc_exists=pvc_exists,
            image_volumes=self.config.image_volumes,
            policy=self.config.policy,
        )

    def reconcile(self, body: Mapping[str, Any], nodes: Iterable[NodeFacts]) -> Plan:
        """One full pass for the service ``body``.

        Raises:
            ApiError: an API call failed; the caller retries the retryable ones with backoff.
        """
        ref = parse_service_ref(body)
        started = time.monotonic()
        with self.lock(ref.namespace, ref.name):
            try:
                plan = self._reconcile_locked(ref, body, nodes)
            except ApiError as error:
                self.metrics.reconcile_total.labels(result="retry" if error.retryable else "error").inc()
                self._record_failure(ref, body, "ApiError", str(error))
                raise
            finally:
                self.metrics.reconcile_duration.observe(time.monotonic() - started)
        self.metrics.reconcile_total.labels(
            result="invalid" if plan.status["phase"] == "Failed" else "success"
        ).inc()
        self._phases[(ref.namespace, ref.name)] = plan.status["phase"]
        self.metrics.set_phases(self._phases)
        return plan

    def _reconcile_locked(self, ref: ServiceRef, body: Mapping[str, Any], nodes: Iterable[NodeFacts]) -> Plan:
        spec = body.get("spec") or {}
        previous = body.get("status") or {}
        facts = self.read_facts(ref, spec, nodes)
        plan = reconcile(ref, spec, previous, facts, now=self.clock())
        existed_before = (
            previous.get("observedGeneration") == ref.generation and previous.get("phase") != "Failed"
        )
        changes: list[Change] = []  # reported one by one: a pass failing half-way still tells what it did
        try:
            for obj in plan.apply:
                live = plan.live_fields.get(obj["kind"], ())
                change = apply_object(
                    self.client, obj, owner_uid=ref.uid, existed_before=existed_before, live_fields=live
                )
                changes.append(self._report(body, change))
        except OwnershipError as error:
            self._record_failure(ref, body, "NameConflict", str(error))
            self.post_event(body, "Warning", "NameConflict", str(error))
            raise ApiError(409, "NameConflict", str(error), call="apply") from None
        for kind in plan.delete:
            name = names.owned_name(ref.name, kind)
            deleted = delete_object(
                self.client, kind, ref.namespace, name, owner_name=ref.name, owner_uid=ref.uid
            )
            if deleted is not None:
                changes.append(self._report(body, deleted))
        if plan.status != previous:
            self.client.patch(
                names.KIS,
                ref.namespace,
                ref.name,
                {"status": removal_patch(plan.status, previous)},
                subresource="status",
            )
        for event in plan.events:
            self.post_event(body, event.type, event.reason, event.message)
        logger.info(
            "reconciled %s/%s generation %d: phase %s, %s",
            ref.namespace,
            ref.name,
            ref.generation,
            plan.status["phase"],
            ", ".join(f"{c.kind} {c.action}" for c in changes if c.action != UNCHANGED) or "no changes",
        )
        return plan

    def reconcile_key(self, namespace: str, name: str, nodes: Iterable[NodeFacts]) -> Plan | None:
        """Reconcile the service by name (fresh read); None when it is gone or being deleted."""
        body = self.client.get(names.KIS, namespace, name)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return None
        return self.reconcile(body, nodes)

    def cleanup(self, body: Mapping[str, Any]) -> list[Change]:
        """Delete every object the service owns (the finalizer's work on deletion)."""
        ref = parse_service_ref(body)
        changes: list[Change] = []
        with self.lock(ref.namespace, ref.name):
            served = self.client.served_plurals(names.MONITORING_GROUP_VERSION)
            for kind in reversed(names.OWNED_KINDS):
                if kind in names.MONITORING_KINDS and kind.plural not in served:
                    continue
                name = names.owned_name(ref.name, kind)
                change = delete_object(
                    self.client, kind, ref.namespace, name, owner_name=ref.name, owner_uid=ref.uid
                )
                if change is not None:
                    changes.append(self._report(body, change))
        self._phases.pop((ref.namespace, ref.name), None)
        self.metrics.set_phases(self._phases)
        logger.info(
            "cleaned up %s/%s: %s",
            ref.namespace,
            ref.name,
            ", ".join(f"{c.kind} {c.action}" for c in changes) or "nothing to delete",
        )
        return changes

    def _report(self, body: Mapping[str, Any], change: Change) -> Change:
        """Count ``change`` and post its event (unchanged objects are neither)."""
        if change.action in _CHANGE_EVENTS:
            self.metrics.object_changes.labels(kind=change.kind, action=change.action).inc()
            type_, reason, text = _CHANGE_EVENTS[change.action]
            self.post_event(body, type_, reason, text.format(kind=change.kind, name=change.name))
        return change

    def _record_failure(self, ref: ServiceRef, body: Mapping[str, Any], reason: str, message: str) -> None:
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

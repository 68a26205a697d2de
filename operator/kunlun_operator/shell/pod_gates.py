"""The shell around ``health_gate``: set the readiness gate of pods nobody reported on, and say so.

Owns: the ``pods/status`` writes of the operator's ``NoHealthReporter`` condition, the Warning
events on the pod and on its service, the metric, the memory of when each waiting pod was first
seen, and of which error each pod's failed write last met (a failure is announced once per pod and
error: one Warning event on the service and one log line, not one every retry). Synchronous
(called from the controller's pass). Invariant: a write carries the pod's ``resourceVersion`` as
a precondition, so a verdict the device plugin wrote since the pod was read is never overwritten
(the API answers 409 and the pod's next event shows the verdict); a failed write is retried, never
turned into a ``False``.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kunlun_operator import names
from kunlun_operator.decide.health_gate import (
    GATE_RETRY_SECONDS,
    REASON_CANNOT_SET_GATE,
    REASON_NO_HEALTH_REPORTER,
    GatedPod,
    GateOutcome,
    gate_condition,
    opened_message,
    plan_gates,
    write_failed_message,
)
from kunlun_operator.decide.replicas import parse_time
from kunlun_operator.errors import ApiError
from kunlun_operator.shell.kube import POD, KubeClient
from kunlun_operator.shell.metrics import OperatorMetrics
from kunlun_operator.spec.service import ServiceRef

logger = logging.getLogger(__name__)

#: Posts a Kubernetes Event about ``body`` (an object or its reference): (body, type, reason, message).
EventSink = Callable[[Mapping[str, Any], str, str, str], None]


def service_reference(ref: ServiceRef) -> dict[str, Any]:
    """The body an Event about the service ``ref`` needs (what kopf's object reference reads)."""
    return {
        "apiVersion": names.KIS.api_version,
        "kind": names.KIS.kind,
        "metadata": {"name": ref.name, "namespace": ref.namespace, "uid": ref.uid},
    }


def pod_reference(namespace: str, pod: GatedPod) -> dict[str, Any]:
    """The smallest body an Event about ``pod`` needs (list items carry no apiVersion and kind)."""
    return {
        "apiVersion": POD.api_version,
        "kind": POD.kind,
        "metadata": {"name": pod.name, "namespace": namespace, "uid": pod.uid},
    }


class GateOpener:
    """Opens the readiness gates ``health_gate.plan_gates`` says are due, one service at a time."""

    def __init__(
        self,
        client: KubeClient,
        metrics: OperatorMetrics,
        post_event: EventSink,
        *,
        grace_seconds: float,
    ) -> None:
        self.client = client
        self.metrics = metrics
        self.post_event = post_event
        self.grace_seconds = grace_seconds
        # Per service: pod uid -> when the operator first saw it waiting for a report.
        self._first_seen: dict[tuple[str, str], dict[str, datetime.datetime]] = {}
        self._unmonitored: dict[tuple[str, str], int] = {}
        # Per service: pod uid -> the error its last failed write met (announced already).
        self._failures: dict[tuple[str, str], dict[str, str]] = {}

    def open_gates(self, ref: ServiceRef, pods: Iterable[GatedPod], now: str) -> GateOutcome:
        """Set ``kunlun.dev/xpu-healthy=True`` (``NoHealthReporter``) on each pod of the service
        ``ref`` whose report is overdue; the outcome the service's condition reports."""
        key = (ref.namespace, ref.name)
        current = parse_time(now) or datetime.datetime.now(datetime.UTC)
        pods = tuple(pods)
        first_seen = self._first_seen.setdefault(key, {})
        waiting_uids = {p.uid for p in pods if p.awaiting_report}
        for uid in set(first_seen) - waiting_uids:
            del first_seen[uid]  # reported, gone or not ready: a new wait starts anew
        for uid in waiting_uids:
            first_seen.setdefault(uid, current)
        plan = plan_gates(pods, now=current, grace_seconds=self.grace_seconds, first_seen=first_seen)
        opened: list[GatedPod] = []
        failed: list[tuple[GatedPod, str]] = []
        retry = False
        for pod in plan.open:
            try:
                self._write(ref.namespace, pod, now)
            except ApiError as error:
                if error.status == 409:  # written meanwhile (the plugin's verdict, most likely)
                    retry = True
                elif error.status != 404:  # 404: the pod is gone
                    failed.append((pod, f"{error.status} {error.reason}"))
                    self._announce_failure(ref, pod, failed[-1][1], error)
                continue
            opened.append(pod)
            first_seen.pop(pod.uid, None)
            message = opened_message(pod, self.grace_seconds)
            self.post_event(pod_reference(ref.namespace, pod), "Warning", REASON_NO_HEALTH_REPORTER, message)
            self.post_event(service_reference(ref), "Warning", REASON_NO_HEALTH_REPORTER, message)
            self.metrics.health_gates_opened.inc()
            logger.warning("%s/%s: %s", ref.namespace, ref.name, message)
        recheck = plan.recheck_after_seconds
        if failed or retry:
            recheck = min(recheck or GATE_RETRY_SECONDS, GATE_RETRY_SECONDS)
        failures = self._failures.setdefault(key, {})
        for uid in set(failures) - {pod.uid for pod, _ in failed}:
            del failures[uid]  # written, reported, gone or not due: a later failure is news again
        self._unmonitored[key] = len(plan.opened) + len(opened)
        self.metrics.unmonitored_pods.set(sum(self._unmonitored.values()))
        return GateOutcome(
            grace_seconds=self.grace_seconds,
            waiting=plan.waiting,
            opened=(*plan.opened, *opened),
            failed=tuple(failed),
            recheck_after_seconds=recheck,
            held=plan.held,
        )

    def forget(self, namespace: str, name: str) -> None:
        """Drop what is kept about a deleted service."""
        self._first_seen.pop((namespace, name), None)
        self._failures.pop((namespace, name), None)
        self._unmonitored.pop((namespace, name), None)
        self.metrics.unmonitored_pods.set(sum(self._unmonitored.values()))

    def _announce_failure(self, ref: ServiceRef, pod: GatedPod, reason: str, error: ApiError) -> None:
        """One Warning event on the service and one log line per pod and error; retries meeting the
        same error log at debug."""
        failures = self._failures.setdefault((ref.namespace, ref.name), {})
        if failures.get(pod.uid) == reason:
            logger.debug("still cannot set the readiness gate of %s: %s", pod.describe(), error)
            return
        failures[pod.uid] = reason
        message = write_failed_message(pod, reason)
        self.post_event(service_reference(ref), "Warning", REASON_CANNOT_SET_GATE, message)
        logger.warning(
            "%s/%s: %s (retried every %gs): %s", ref.namespace, ref.name, message, GATE_RETRY_SECONDS, error
        )

    def _write(self, namespace: str, pod: GatedPod, now: str) -> None:
        """Add our condition to the pod's, guarded by the resourceVersion it was read at.

        A merge patch replaces the conditions list, so it carries every condition as read; the
        precondition makes that safe (a pod changed since answers 409, nothing is lost).
        """
        conditions = [*(dict(c) for c in pod.conditions), gate_condition(now, self.grace_seconds)]
        patch = {"metadata": {"resourceVersion": pod.resource_version}, "status": {"conditions": conditions}}
        self.client.patch(POD, namespace, pod.name, patch, subresource="status")

"""The readiness gate when nobody reports card health: when the operator sets it, and what it says.

Owns: reading from a runtime pod what its ``kunlun.dev/xpu-healthy`` readiness gate needs, the
decision whose gate the operator sets now (pure: pods, ``now`` and the grace period in; pods out),
the condition it writes on such a pod, its event texts, and the service's ``CardHealthReported``
condition. Must not talk to the API or read the clock.

Policy (docs/operator.md, "When no device plugin reports"): the device plugin's node agent sets the
condition on every pod holding a card, True as soon as it sees the pod. If it never does (down,
restarting, its ``pods/status`` patch denied), the gate keeps the pod NotReady forever and a rollout
stalls without a word. So a pod that carries the gate, is Running with every container ready, and
still has no such condition ``grace`` seconds after its containers became ready gets it ``True``
with reason ``NoHealthReporter`` from the operator: it fails open, loudly (Warning events on the pod
and the service, ``CardHealthReported=False``, a metric). Invariant: the operator never sets
``False`` and never writes a condition that exists, whoever wrote it; the shell writes with the pod's
``resourceVersion`` as a precondition, so a verdict arriving meanwhile is never overwritten, and a
device plugin that comes back replaces ours with its own. A grace of 0 never opens a gate, and
neither is the gate of a pod whose card the kubelet reports Unhealthy (``allocatedResourcesStatus``)
ever opened: the plugin is up and its verdict was lost, so the pod stays NotReady and the service's
condition names it.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kunlun_operator import names
from kunlun_operator.decide.replicas import parse_time, unhealthy_resource_ids
from kunlun_operator.decide.status import Condition

CONDITION_TYPE = "CardHealthReported"
REASON_NO_HEALTH_REPORTER = "NoHealthReporter"
#: The Warning event when the operator's own write of a gate fails (once per pod and error).
REASON_CANNOT_SET_GATE = "CannotSetHealthGate"
#: How soon to look again after a write of ours failed or lost a race (the pod's own events wake
#: the loop sooner when something else wrote).
GATE_RETRY_SECONDS = 10.0


@dataclass(frozen=True, slots=True)
class GatedPod:
    """A runtime pod carrying the readiness gate, as read for ``plan_gates``."""

    name: str
    uid: str
    node: str | None
    resource_version: str
    #: Running, not terminating, and ``ContainersReady`` True: only the gate keeps it NotReady.
    containers_ready: bool
    ready_since: datetime.datetime | None  # ContainersReady's lastTransitionTime
    #: The ``kunlun.dev/xpu-healthy`` condition's ``(status, reason)``; None: nobody set it.
    health: tuple[str, str] | None
    #: The pod's conditions as read: a merge patch replaces the list, so a write carries them all.
    conditions: tuple[Mapping[str, Any], ...] = ()
    #: The cards of this pod the kubelet reports Unhealthy (``allocatedResourcesStatus``, read by
    #: ``replicas.unhealthy_resource_ids``): the device plugin runs and knows, even if its verdict
    #: never reached the pod, so the operator never opens this pod's gate.
    unhealthy_cards: tuple[str, ...] = ()

    def describe(self) -> str:
        return f"pod {self.name} on node {self.node or 'unknown'}"

    @property
    def awaiting_report(self) -> bool:
        """Containers ready, no report on the gate, no card the kubelet knows to be Unhealthy."""
        return self.containers_ready and self.health is None and not self.unhealthy_cards

    @property
    def opened_by_operator(self) -> bool:
        return self.health is not None and self.health[1] == REASON_NO_HEALTH_REPORTER


@dataclass(frozen=True, slots=True)
class GatePlan:
    """What ``plan_gates`` decided at ``now``."""

    open: tuple[GatedPod, ...]  # no report for the grace period: the operator sets the gate now
    waiting: tuple[GatedPod, ...]  # containers ready, no report yet, within the grace period
    opened: tuple[GatedPod, ...]  # still carry the operator's NoHealthReporter condition
    recheck_after_seconds: float | None  # when the first waiting pod becomes due
    #: Containers ready, no report, but the kubelet reports a card Unhealthy: never opened.
    held: tuple[GatedPod, ...] = ()


@dataclass(frozen=True, slots=True)
class GateOutcome:
    """The plan after the shell wrote: what the service's condition reports."""

    grace_seconds: float = 120.0
    waiting: tuple[GatedPod, ...] = ()
    opened: tuple[GatedPod, ...] = ()  # by the operator, in this pass or before
    failed: tuple[tuple[GatedPod, str], ...] = ()  # the operator's own write failed (not a race)
    recheck_after_seconds: float | None = None
    held: tuple[GatedPod, ...] = ()  # no report, a card the kubelet reports Unhealthy: kept shut


def _condition(pod: Mapping[str, Any], type_: str) -> Mapping[str, Any]:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == type_), {})


def gated_pod(pod: Mapping[str, Any]) -> GatedPod | None:
    """The gate's view of ``pod``; None when the pod carries no readiness gate on our condition."""
    spec = pod.get("spec") or {}
    gates = [g.get("conditionType") for g in spec.get("readinessGates") or []]
    if names.XPU_HEALTHY_CONDITION not in gates:
        return None
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    ready = _condition(pod, "ContainersReady")
    health = _condition(pod, names.XPU_HEALTHY_CONDITION)
    return GatedPod(
        name=str(meta.get("name")),
        uid=str(meta.get("uid") or meta.get("name")),
        node=spec.get("nodeName"),
        resource_version=str(meta.get("resourceVersion") or ""),
        containers_ready=status.get("phase") == "Running"
        and not meta.get("deletionTimestamp")
        and ready.get("status") == "True",
        ready_since=parse_time(ready.get("lastTransitionTime")),
        health=(str(health.get("status")), str(health.get("reason") or "")) if health else None,
        conditions=tuple(status.get("conditions") or ()),
        unhealthy_cards=tuple(unhealthy_resource_ids(pod)),
    )


def plan_gates(
    pods: Iterable[GatedPod],
    *,
    now: datetime.datetime,
    grace_seconds: float,
    first_seen: Mapping[str, datetime.datetime] | None = None,
) -> GatePlan:
    """Whose gate the operator sets at ``now``.

    Args:
        pods: the service's gated pods (``gated_pod`` of each).
        now: the current time (aware).
        grace_seconds: how long a pod with ready containers waits for the device plugin's
            report; 0: forever (the operator never sets the gate).
        first_seen: per pod uid, when the operator first saw it waiting; a pod waits from the
            earlier of this and its containers' ready time.
    Returns:
        The pods to set now, those waiting, those set by the operator earlier, in how many
        seconds the first waiting one becomes due (None: none, or a grace of 0), and those held
        shut because the kubelet reports one of their cards Unhealthy.
    """
    seen = first_seen or {}
    to_open, waiting, opened, held = [], [], [], []
    recheck: float | None = None
    for pod in sorted(pods, key=lambda p: p.name):
        if pod.opened_by_operator:
            opened.append(pod)
            continue
        if pod.health is not None or not pod.containers_ready:
            continue  # reported (the plugin's verdict stands), or not ready for other reasons
        if pod.unhealthy_cards:
            held.append(pod)  # a known-bad card: its pod event wakes the loop if that changes
            continue
        dates = [t for t in (pod.ready_since, seen.get(pod.uid)) if t is not None]
        remaining = grace_seconds - (now - min(dates, default=now)).total_seconds()
        if grace_seconds > 0 and remaining <= 0:
            to_open.append(pod)
            continue
        waiting.append(pod)
        if grace_seconds > 0:
            recheck = remaining if recheck is None else min(recheck, remaining)
    return GatePlan(tuple(to_open), tuple(waiting), tuple(opened), recheck, tuple(held))


def gate_condition(now: str, grace_seconds: float) -> dict[str, Any]:
    """The ``kunlun.dev/xpu-healthy`` condition the operator writes on a pod nobody reported on."""
    return {
        "type": names.XPU_HEALTHY_CONDITION,
        "status": "True",
        "reason": REASON_NO_HEALTH_REPORTER,
        "message": (
            f"set by {names.MANAGER}: no device plugin reported this pod's card health within "
            f"{grace_seconds:g}s of its containers becoming ready; its cards are not monitored"
        ),
        "lastTransitionTime": now,
    }


def opened_message(pod: GatedPod, grace_seconds: float) -> str:
    """The Warning event ``NoHealthReporter`` (on the pod and on the service) when a gate is set."""
    return (
        f"no device plugin reported the card health of {pod.describe()} within {grace_seconds:g}s of "
        f"its containers becoming ready: the operator set {names.XPU_HEALTHY_CONDITION}=True "
        f"(reason {REASON_NO_HEALTH_REPORTER}) so the pod can serve, unmonitored; check the device "
        f"plugin on that node (its pod, its log, its right to patch pods/status)"
    )


def write_failed_message(pod: GatedPod, error: str) -> str:
    """Why ``pod``'s gate stays shut when the operator's own write failed with ``error``: the
    service's condition and the Warning event ``CannotSetHealthGate``."""
    return (
        f"{pod.describe()} has no card health report and the operator could not set its gate "
        f"({error}; it needs patch on pods/status)"
    )


def health_reported_condition(outcome: GateOutcome, *, gate: bool = True) -> Condition:
    """``CardHealthReported``: whether a device plugin reports the card health of every ready pod;
    ``gate``: the runtime pods carry the readiness gate (``--xpu-health-gate``)."""
    if not gate:
        return Condition(
            CONDITION_TYPE,
            "Unknown",
            "GateOff",
            f"the runtime pods carry no readiness gate on {names.XPU_HEALTHY_CONDITION} "
            "(--no-xpu-health-gate): card health does not gate readiness",
        )
    parts = []
    if outcome.opened:
        listed = ", ".join(p.describe() for p in outcome.opened)
        parts.append(
            f"no device plugin reports the card health of {listed}: the operator set its gate "
            f"(reason {REASON_NO_HEALTH_REPORTER}) and its cards are not monitored"
        )
    parts.extend(write_failed_message(pod, error) for pod, error in outcome.failed)
    for pod in outcome.held:
        parts.append(
            f"{pod.describe()} has no card health report but the kubelet reports its card "
            f"{','.join(pod.unhealthy_cards)} Unhealthy: the operator does not set its gate and the "
            f"pod stays NotReady (the device plugin runs but its verdict did not reach the pod: "
            f"check its right to patch pods/status)"
        )
    if outcome.waiting:
        listed = ", ".join(p.describe() for p in outcome.waiting)
        then = (
            f"the operator sets it after {outcome.grace_seconds:g}s"
            if outcome.grace_seconds > 0
            else "the operator never sets it (grace 0): the pod stays NotReady until one does"
        )
        parts.append(f"waiting for a device plugin to report the card health of {listed}; {then}")
    if outcome.opened or outcome.failed or outcome.held:
        return Condition(CONDITION_TYPE, "False", REASON_NO_HEALTH_REPORTER, "; ".join(parts))
    if outcome.waiting:
        return Condition(CONDITION_TYPE, "False", "AwaitingHealthReport", "; ".join(parts))
    return Condition(
        CONDITION_TYPE,
        "True",
        "HealthReported",
        "a device plugin reports the card health of every ready runtime pod",
    )

"""What every pod holding our cards must be told: its condition and, for a card that flipped, an Event (pure).

A pod's `kunlun.dev/xpu-healthy` condition is "False" while any card it holds is Unhealthy (or
quarantined) and "True" when all of them are Healthy. Every pod holding a card gets the condition —
also a new pod on a healthy card, whose readiness gate waits for "True" — and it is rewritten only
when the verdict differs from the one last written. Each (pod, card) pair of a card that flipped
gets one Event: Warning when the card failed, Normal when it recovered.

Invariant: no I/O and no clock — the caller passes the holders (from PodResources), the card
states and the time.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kunlun_device.labels import (
    REASON_XPU_HEALTHY,
    REASON_XPU_QUARANTINED,
    REASON_XPU_UNHEALTHY,
    XPU_HEALTHY_CONDITION,
    xpu_card_name,
)
from kunlun_device.podresources import Holder

COMPONENT = "kunlun-device-plugin"


@dataclass(frozen=True, slots=True, order=True)
class PodRef:
    """A pod, by namespace and name."""

    namespace: str
    name: str


@dataclass(frozen=True, slots=True)
class CardStatus:
    """One card as the node agent reports it to pods (tracker state with the quarantine applied)."""

    index: int
    uuid: str
    healthy: bool
    quarantined: bool
    detail: str  # why: the failed checks and their messages, or how it recovered

    @property
    def name(self) -> str:
        return xpu_card_name(self.index, self.uuid)

    @property
    def reason(self) -> str:
        if self.healthy:
            return REASON_XPU_HEALTHY
        return REASON_XPU_QUARANTINED if self.quarantined else REASON_XPU_UNHEALTHY


@dataclass(frozen=True, slots=True)
class PodVerdict:
    """The condition one pod must carry now."""

    pod: PodRef
    healthy: bool
    reason: str
    message: str


def cards_by_pod(holders: Mapping[str, Holder]) -> dict[PodRef, frozenset[str]]:
    """Pod -> UUIDs of the cards its containers hold, from PodResources' device id -> holder map."""
    pods: dict[PodRef, set[str]] = {}
    for uuid, holder in holders.items():
        pods.setdefault(PodRef(holder.namespace, holder.pod), set()).add(uuid)
    return {pod: frozenset(uuids) for pod, uuids in pods.items()}


def pod_verdicts(
    holders: Mapping[str, Holder], cards: Mapping[str, CardStatus], node: str
) -> list[PodVerdict]:
    """The verdict of every pod holding at least one of `cards`, sorted by pod.

    Args:
        holders: device id -> holder, from `kunlun_device.podresources`.
        cards: UUID -> status of every card of the node.
        node: the node name, for the messages.
    """
    verdicts = []
    for pod, uuids in sorted(cards_by_pod(holders).items()):
        held = sorted((cards[u] for u in uuids if u in cards), key=lambda c: c.index)
        if not held:
            continue
        failed = [c for c in held if not c.healthy]
        if failed:
            reason = REASON_XPU_QUARANTINED if any(c.quarantined for c in failed) else REASON_XPU_UNHEALTHY
            message = f"node {node}: " + "; ".join(f"{c.name}: {c.detail}" for c in failed)
            verdicts.append(PodVerdict(pod, False, reason, message))
        else:
            names = ", ".join(c.name for c in held)
            verdicts.append(PodVerdict(pod, True, REASON_XPU_HEALTHY, f"node {node}: healthy: {names}"))
    return verdicts


def verdicts_to_write(
    verdicts: Iterable[PodVerdict], written: Mapping[PodRef, PodVerdict]
) -> list[PodVerdict]:
    """The verdicts that differ from what was last written to their pod (all of them for a new pod)."""
    return [v for v in verdicts if written.get(v.pod) != v]


def events_due(holders: Mapping[str, Holder], flipped: Iterable[str]) -> set[tuple[PodRef, str]]:
    """(pod, card UUID) pairs that get an Event: every pod holding a card whose health flipped."""
    return {(PodRef(holders[u].namespace, holders[u].pod), u) for u in flipped if u in holders}


def _timestamp(now: datetime.datetime) -> str:
    return now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def build_status_patch(verdict: PodVerdict, since: datetime.datetime) -> dict[str, Any]:
    """A strategic-merge patch of the pod's status setting our condition (merged by `type`).

    `since` is the `lastTransitionTime`: when the condition's status last changed.
    """
    condition = {
        "type": XPU_HEALTHY_CONDITION,
        "status": "True" if verdict.healthy else "False",
        "reason": verdict.reason,
        "message": verdict.message,
        "lastTransitionTime": _timestamp(since),
    }
    return {"status": {"conditions": [condition]}}


def build_event(
    pod: PodRef, pod_uid: str | None, card: CardStatus, node: str, now: datetime.datetime
) -> dict[str, Any]:
    """A core/v1 Event on `pod` for the change of `card`: Warning when it failed, Normal when it recovered."""
    state = "Healthy" if card.healthy else "quarantined" if card.quarantined else "Unhealthy"
    involved: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "namespace": pod.namespace,
        "name": pod.name,
    }
    if pod_uid:
        involved["uid"] = pod_uid
    stamp = _timestamp(now)
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{pod.name}.", "namespace": pod.namespace},
        "involvedObject": involved,
        "type": "Normal" if card.healthy else "Warning",
        "reason": card.reason,
        "message": f"node {node}: {card.name} {state}: {card.detail}",
        "source": {"component": COMPONENT, "host": node},
        "reportingComponent": COMPONENT,
        "reportingInstance": node,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }

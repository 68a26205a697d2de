"""Replicas on a failed card: which card is unhealthy, since when, and which pods to evict now.

Owns: reading card health from a pod (two sources, below), the decision which replicas to replace
(pure: pods, ``now``, ``replaceAfter`` and what was already evicted in, pods to evict out), and the
``ReplicasHealthy`` condition and events that report it. Must not talk to the API or read the clock.
Invariant: a pod is evicted at most once per decision, never before its card was unhealthy for
``replaceAfter``, and never while it is already terminating.

Health sources, best first:
1. ``status.containerStatuses[].allocatedResourcesStatus`` (Kubernetes ResourceHealthStatus,
   1.31+): ``[{name: kunlunxin.com/xpu, resources: [{resourceID, health: Healthy|Unhealthy|Unknown}]}]``.
   A pod claiming its cards (DRA) has them under ``claim:<pod claim>[/<request>]`` instead, each
   device's ``resourceID`` the first CDI id our DRA plugin returned for it
   (``kunlun.dev/xpu=<claim uid>-xpu-5``) or, without one, ``xpu.kunlun.dev/<pool>/xpu-5``; the card
   is then the device name (``xpu-5``). It carries no time, so the operator uses the time it first
   saw the card unhealthy.
2. Our pod condition ``kunlun.dev/xpu-healthy`` (the device plugin's node agent): ``False`` with a
   reason and a message naming node and card; its ``lastTransitionTime`` is the start of the fault.

A fault counts from the earlier of its ``lastTransitionTime`` and the time the operator first saw
it: a node agent restarting mid-fault may write the condition again with a later time, which must
not restart the ``replaceAfter`` countdown (a crashlooping agent would postpone replacement forever).
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kunlun_device.labels import XPU_CARD_IN_MESSAGE
from kunlun_operator import names
from kunlun_operator.decide.status import Condition

Source = Literal["allocatedResourcesStatus", "condition"]
CONDITION_TYPE = "ReplicasHealthy"
#: How long to wait before asking again when the PodDisruptionBudget has no budget left (429) or an
#: eviction failed otherwise; ``kubectl drain`` retries at the same pace.
EVICTION_RETRY_SECONDS = 5.0
#: ``reason`` of a fault seen only in allocatedResourcesStatus (it has no reason of its own).
REASON_DEVICE_UNHEALTHY = "DeviceUnhealthy"
_REASON = re.compile(r"^[A-Za-z][A-Za-z0-9]{0,62}$")  # CamelCase: safe as a metric label value
#: The kubelet's name of a DRA claim's entry in allocatedResourcesStatus: ``claim:<claim>[/<request>]``.
CLAIM_STATUS_PREFIX = "claim:"
#: The CDI kind of our DRA plugin's devices (``kunlun_device.dra.cdi.CDI_KIND``, kept equal by a test:
#: the operator may import only ``kunlun_device.labels`` and ``.dra.semver``).
DRA_CDI_KIND = "kunlun.dev/xpu"
_CDI_CARD = re.compile(r"-(xpu-[0-9]+)$")  # <claim uid>-xpu-<index>


@dataclass(frozen=True, slots=True)
class CardFault:
    """One replica whose card is unhealthy, as read from its pod."""

    pod: str
    uid: str
    node: str | None  # spec.nodeName
    card: str  # the resourceID, or the card the condition's message names ("unknown" if none)
    reason: str  # CamelCase: the condition's reason, or REASON_DEVICE_UNHEALTHY
    message: str
    source: Source
    since: datetime.datetime | None  # None: the source has no time (the caller's first sighting)
    terminating: bool = False  # metadata.deletionTimestamp is set: already on its way out

    def describe(self) -> str:
        """``pod qwen-1 on node xpu-1 (card 5)``: what events and conditions name."""
        return f"pod {self.pod} on node {self.node or 'unknown'} (card {self.card})"


@dataclass(frozen=True, slots=True)
class ReplacementPlan:
    """What ``plan_replacements`` decided for one service at ``now``."""

    evict: tuple[CardFault, ...]  # unhealthy for at least replaceAfter: evict now
    waiting: tuple[CardFault, ...]  # unhealthy, not yet for replaceAfter
    in_flight: tuple[CardFault, ...]  # already evicted (terminating, or accepted earlier)
    recheck_after_seconds: float | None  # when the first waiting one becomes due


@dataclass(frozen=True, slots=True)
class ReplacementOutcome:
    """The plan after the shell asked the API to evict: what the status and events report."""

    waiting: tuple[CardFault, ...] = ()
    in_flight: tuple[CardFault, ...] = ()
    evicted: tuple[CardFault, ...] = ()  # the API accepted the eviction in this pass
    blocked: tuple[CardFault, ...] = ()  # 429: the PodDisruptionBudget has no budget left
    failed: tuple[tuple[CardFault, str], ...] = ()  # any other API error, with its text
    replace_after_seconds: float = 120.0
    recheck_after_seconds: float | None = None  # when the loop should look again (None: on events)


def parse_time(text: str | None) -> datetime.datetime | None:
    """An RFC 3339 time (``2026-01-01T00:00:00Z``) as an aware datetime; None if absent or bad."""
    if not text:
        return None
    try:
        parsed = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=datetime.UTC)


def our_card(name: str, resource_id: str) -> str | None:
    """The card an ``allocatedResourcesStatus`` entry ``name`` reports as ``resource_id``, if it is
    ours: the device plugin's resource (its device id as is) or a claimed device of our DRA driver
    (its device name, ``xpu-5``); None for anything else."""
    if name == names.RESOURCE_NAME:
        return resource_id
    if not name.startswith(CLAIM_STATUS_PREFIX):
        return None
    if resource_id.startswith(f"{names.DRA_DRIVER}/"):  # <driver>/<pool>/<device>
        return resource_id.rpartition("/")[2]
    if resource_id.startswith(f"{DRA_CDI_KIND}="):
        match = _CDI_CARD.search(resource_id)
        return match.group(1) if match else resource_id
    return None


def _unhealthy(pod: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(entry name, card)`` of each of our cards ``allocatedResourcesStatus`` reports Unhealthy."""
    status = pod.get("status") or {}
    found = []
    for container in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        for resource in container.get("allocatedResourcesStatus") or []:
            name = str(resource.get("name") or "")
            for health in resource.get("resources") or []:
                if health.get("health") != "Unhealthy" or not health.get("resourceID"):
                    continue
                card = our_card(name, str(health["resourceID"]))
                if card is not None:
                    found.append((name, card))
    return found


def unhealthy_resource_ids(pod: Mapping[str, Any]) -> list[str]:
    """Our cards that ``allocatedResourcesStatus`` reports Unhealthy, over all containers (``our_card``)."""
    return [card for _, card in _unhealthy(pod)]


def card_fault(pod: Mapping[str, Any]) -> CardFault | None:
    """The card fault of ``pod``, or None while its cards are healthy (or nobody reports them).

    allocatedResourcesStatus wins where it reports a card Unhealthy (the kubelet's own view);
    our condition is the fallback, and its transition time dates either source's fault.
    """
    meta = pod.get("metadata") or {}
    conditions = (pod.get("status") or {}).get("conditions") or []
    ours: Mapping[str, Any] = next(
        (c for c in conditions if c.get("type") == names.XPU_HEALTHY_CONDITION), {}
    )
    ours_false = ours.get("status") == "False"
    unhealthy = _unhealthy(pod)
    resource_ids = [card for _, card in unhealthy]
    if not resource_ids and not ours_false:
        return None
    message = str(ours.get("message") or "") if ours_false else ""
    reason = str(ours.get("reason") or "") if ours_false else ""
    if resource_ids:
        source: Source = "allocatedResourcesStatus"
        card = ",".join(resource_ids)
        what = names.RESOURCE_NAME if unhealthy[0][0] == names.RESOURCE_NAME else "claimed device"
        message = message or f"the kubelet reports {what} {card} Unhealthy"
        reason = reason or REASON_DEVICE_UNHEALTHY
    else:
        source = "condition"
        card = ",".join(XPU_CARD_IN_MESSAGE.findall(message)) or "unknown"
    return CardFault(
        pod=str(meta.get("name")),
        uid=str(meta.get("uid") or meta.get("name")),
        node=(pod.get("spec") or {}).get("nodeName"),
        card=card,
        reason=reason if _REASON.match(reason) else "Unknown",
        message=message,
        source=source,
        since=parse_time(ours.get("lastTransitionTime")) if ours_false else None,
        terminating=bool(meta.get("deletionTimestamp")),
    )


def plan_replacements(
    faults: Iterable[CardFault],
    *,
    now: datetime.datetime,
    replace_after_seconds: float,
    evicted_uids: frozenset[str] = frozenset(),
    first_seen: Mapping[str, datetime.datetime] | None = None,
) -> ReplacementPlan:
    """Which faulty replicas to evict at ``now``.

    Args:
        faults: the card faults of the service's pods (``card_fault`` of each).
        now: the current time (aware).
        replace_after_seconds: ``spec.faultTolerance.replaceAfter``.
        evicted_uids: pods whose eviction the API already accepted (a stale listing may still
            show them without ``deletionTimestamp``): never evicted twice.
        first_seen: per pod uid, when the operator first saw its current fault (dated or not); a
            fault counts from the earlier of this and its own ``since``.
    Returns:
        The pods to evict now, those still waiting, those already on their way out, and in how
        many seconds the first waiting one becomes due.
    """
    seen = first_seen or {}
    evict, waiting, in_flight = [], [], []
    recheck: float | None = None
    for fault in sorted(faults, key=lambda f: f.pod):
        if fault.terminating or fault.uid in evicted_uids:
            in_flight.append(fault)
            continue
        dates = [t for t in (fault.since, seen.get(fault.uid)) if t is not None]
        since = min(dates) if dates else now
        remaining = replace_after_seconds - (now - since).total_seconds()
        if remaining <= 0:
            evict.append(fault)
        else:
            waiting.append(fault)
            recheck = remaining if recheck is None else min(recheck, remaining)
    return ReplacementPlan(tuple(evict), tuple(waiting), tuple(in_flight), recheck)


def replacement_message(fault: CardFault, replace_after_seconds: float) -> str:
    """The text of the ``ReplacingReplica`` event, posted as soon as the API accepts an eviction."""
    detail = f"{fault.reason}: {fault.message}" if fault.message else fault.reason
    return (
        f"evicting {fault.describe()}: the card has been unhealthy for "
        f"{replace_after_seconds:g}s or more ({detail})"
    )


def replicas_condition(outcome: ReplacementOutcome) -> Condition:
    """``ReplicasHealthy``: True, or why a replica on a failed card is not replaced yet."""
    after = f"{outcome.replace_after_seconds:g}s"
    if outcome.blocked:
        listed = ", ".join(f.describe() for f in outcome.blocked)
        return Condition(
            CONDITION_TYPE,
            "False",
            "WaitingForDisruptionBudget",
            f"cannot evict {listed} yet: the PodDisruptionBudget allows no disruption now; "
            f"retrying every {EVICTION_RETRY_SECONDS:g}s",
        )
    if outcome.evicted or outcome.in_flight or outcome.failed:
        parts = [f"evicted {f.describe()}: {f.reason}" for f in (*outcome.evicted, *outcome.in_flight)]
        parts += [f"eviction of {f.describe()} failed ({error}); retrying" for f, error in outcome.failed]
        return Condition(CONDITION_TYPE, "False", "ReplacingReplica", "; ".join(parts))
    if outcome.waiting:
        listed = "; ".join(f"{f.describe()}: {f.reason} {f.message}".rstrip() for f in outcome.waiting)
        return Condition(
            CONDITION_TYPE, "False", "CardUnhealthy", f"{listed}; replaced after {after} unhealthy"
        )
    return Condition(CONDITION_TYPE, "True", "AllCardsHealthy", "every replica's cards are healthy")

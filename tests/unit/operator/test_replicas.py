"""Replicas on a failed card: health from a pod, when to evict, what status and events say."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from kunlun_device.dra.cdi import CDI_KIND, cdi_device_id
from kunlun_operator import names
from kunlun_operator.decide.reconcile import PodFacts, reconcile
from kunlun_operator.decide.replicas import (
    DRA_CDI_KIND,
    CardFault,
    ReplacementOutcome,
    card_fault,
    parse_time,
    plan_replacements,
    replicas_condition,
)
from kunlun_operator.shell.handlers import _pod_fingerprint
from kunlun_operator.spec.service import parse_spec, parse_spec_or_error
from tests.unit.operator.factories import NOW, make_facts, make_raw_spec, make_ref

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


def make_pod(
    name: str = "qwen-1",
    *,
    condition: dict[str, Any] | None = None,
    resources: list[dict[str, str]] | None = None,
    terminating: bool = False,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "uid": f"uid-{name}"}
    if terminating:
        meta["deletionTimestamp"] = NOW
    status: dict[str, Any] = {"conditions": [{"type": "Ready", "status": "True"}]}
    if condition is not None:
        status["conditions"].append({"type": names.XPU_HEALTHY_CONDITION, **condition})
    if resources is not None:
        status["containerStatuses"] = [
            {
                "name": "runtime",
                "allocatedResourcesStatus": [{"name": "kunlunxin.com/xpu", "resources": resources}],
            }
        ]
    return {"metadata": meta, "spec": {"nodeName": "xpu-1"}, "status": status}


ECC = {
    "status": "False",
    "reason": "XpuUnhealthy",
    "message": "node xpu-1: xpu5 (GPU-0005): ecc-uncorrectable: 3 uncorrectable ECC errors",
    "lastTransitionTime": "2026-01-01T00:00:00Z",
}


def make_fault(name: str = "qwen-1", since: datetime.datetime | None = T0, **kw: Any) -> CardFault:
    return CardFault(name, f"uid-{name}", "xpu-1", "5", "XpuUnhealthy", "ecc", "condition", since, **kw)


# --- card_fault: pod -> (since, card, reason) or None ---------------------------------------------


def test_a_pod_without_either_source_or_with_healthy_cards_has_no_fault() -> None:
    assert card_fault(make_pod()) is None
    assert card_fault(make_pod(condition={"status": "True", "reason": "XpuHealthy"})) is None
    healthy = [{"resourceID": "0005", "health": "Healthy"}, {"resourceID": "0006", "health": "Unknown"}]
    assert card_fault(make_pod(resources=healthy)) is None


def test_our_condition_gives_card_reason_and_the_time_the_fault_started() -> None:
    assert card_fault(make_pod(condition=ECC)) == CardFault(
        pod="qwen-1",
        uid="uid-qwen-1",
        node="xpu-1",
        card="5",
        reason="XpuUnhealthy",
        message="node xpu-1: xpu5 (GPU-0005): ecc-uncorrectable: 3 uncorrectable ECC errors",
        source="condition",
        since=T0,
    )


def test_allocated_resources_status_wins_and_is_dated_by_our_condition_when_there_is_one() -> None:
    resources = [{"resourceID": "0004", "health": "Healthy"}, {"resourceID": "0005", "health": "Unhealthy"}]
    alone = card_fault(make_pod(resources=resources))
    assert alone is not None
    assert (alone.source, alone.card, alone.reason, alone.since) == (
        "allocatedResourcesStatus",
        "0005",
        "DeviceUnhealthy",
        None,
    )
    both = card_fault(make_pod(resources=resources, condition=ECC))
    assert both is not None
    assert (both.source, both.card, both.reason, both.since) == (
        "allocatedResourcesStatus",
        "0005",
        "XpuUnhealthy",
        T0,
    )


def test_another_resource_unhealthy_is_not_ours() -> None:
    pod = make_pod()
    pod["status"]["containerStatuses"] = [
        {
            "allocatedResourcesStatus": [
                {"name": "nvidia.com/gpu", "resources": [{"resourceID": "g", "health": "Unhealthy"}]}
            ]
        }
    ]
    assert card_fault(pod) is None


def test_odd_condition_text_is_bounded_a_terminating_pod_is_marked() -> None:
    fault = card_fault(
        make_pod(condition={"status": "False", "reason": "bad reason!", "message": "gone"}, terminating=True)
    )
    assert fault is not None
    assert (fault.card, fault.reason, fault.since, fault.terminating) == ("unknown", "Unknown", None, True)


def claim_pod(*resources: dict[str, str], name: str = "claim:xpus") -> dict[str, Any]:
    """A DRA pod's status as the kubelet writes it: the claim's health under ``claim:<claim>``."""
    pod = make_pod()
    pod["status"]["containerStatuses"] = [
        {"name": "runtime", "allocatedResourcesStatus": [{"name": name, "resources": list(resources)}]}
    ]
    return pod


@pytest.mark.parametrize(
    "resource_id",
    [
        cdi_device_id("0b1c2d3e-claim-uid", 5),  # the first CDI id the DRA plugin returned
        "xpu.kunlun.dev/node-a/xpu-5",  # the kubelet's <driver>/<pool>/<device> without one
    ],
)
@pytest.mark.parametrize("name", ["claim:xpus", "claim:xpus/xpus"])
def test_a_claimed_card_the_kubelet_reports_unhealthy_is_a_fault(resource_id: str, name: str) -> None:
    healthy = {"resourceID": resource_id.replace("5", "4"), "health": "Healthy"}
    fault = card_fault(claim_pod(healthy, {"resourceID": resource_id, "health": "Unhealthy"}, name=name))
    assert fault is not None
    assert (fault.source, fault.card, fault.reason, fault.since) == (
        "allocatedResourcesStatus",
        "xpu-5",
        "DeviceUnhealthy",
        None,
    )
    assert fault.message == "the kubelet reports claimed device xpu-5 Unhealthy"
    assert card_fault(claim_pod(healthy, {"resourceID": resource_id, "health": "Unknown"})) is None


def test_the_operators_cdi_kind_is_the_dra_plugins() -> None:
    assert DRA_CDI_KIND == CDI_KIND


def test_another_drivers_claimed_device_is_not_ours() -> None:
    for resource_id in ("gpu.nvidia.com/node-a/gpu-0", "nvidia.com/gpu=0", "xpu.kunlun.dev.evil/p/xpu-1"):
        assert card_fault(claim_pod({"resourceID": resource_id, "health": "Unhealthy"})) is None


# --- plan_replacements: replace now or wait --------------------------------------------------------


def test_a_fault_younger_than_replace_after_waits_and_says_when_it_is_due() -> None:
    plan = plan_replacements(
        [make_fault()], now=T0 + datetime.timedelta(seconds=10), replace_after_seconds=30
    )
    assert (plan.evict, [f.pod for f in plan.waiting], plan.recheck_after_seconds) == ((), ["qwen-1"], 20.0)


def test_a_fault_as_old_as_replace_after_is_evicted() -> None:
    plan = plan_replacements(
        [make_fault("b"), make_fault("a", since=T0 + datetime.timedelta(seconds=25))],
        now=T0 + datetime.timedelta(seconds=30),
        replace_after_seconds=30,
    )
    assert [f.pod for f in plan.evict] == ["b"]
    assert [f.pod for f in plan.waiting] == ["a"]
    assert plan.recheck_after_seconds == 25.0


def test_already_evicted_or_terminating_pods_are_never_evicted_again() -> None:
    plan = plan_replacements(
        [make_fault("a"), make_fault("b", terminating=True)],
        now=T0 + datetime.timedelta(hours=1),
        replace_after_seconds=30,
        evicted_uids=frozenset({"uid-a"}),
    )
    assert (plan.evict, [f.pod for f in plan.in_flight], plan.recheck_after_seconds) == ((), ["a", "b"], None)


def test_an_undated_fault_counts_from_when_it_was_first_seen() -> None:
    undated = make_fault(since=None)
    now = T0 + datetime.timedelta(seconds=40)
    assert plan_replacements([undated], now=now, replace_after_seconds=30).waiting == (undated,)
    seen = {"uid-qwen-1": T0}
    assert plan_replacements([undated], now=now, replace_after_seconds=30, first_seen=seen).evict == (
        undated,
    )


def test_a_fault_redated_by_a_node_agent_restart_counts_from_its_first_sighting() -> None:
    redated = make_fault(since=T0 + datetime.timedelta(seconds=25))  # the agent restarted at T0+25s
    now = T0 + datetime.timedelta(seconds=30)
    seen = {"uid-qwen-1": T0}
    plan = plan_replacements([redated], now=now, replace_after_seconds=30, first_seen=seen)
    assert plan.evict == (redated,)
    # the condition's time still wins when it is the earlier one (the operator started late)
    late = {"uid-qwen-1": T0 + datetime.timedelta(seconds=29)}
    assert plan_replacements([make_fault()], now=now, replace_after_seconds=30, first_seen=late).evict == (
        make_fault(),
    )


def test_replace_after_zero_evicts_at_once() -> None:
    assert plan_replacements([make_fault()], now=T0, replace_after_seconds=0).evict == (make_fault(),)


# --- the condition, the count, the events ------------------------------------------------------------


@pytest.mark.parametrize(
    ("outcome", "status", "reason"),
    [
        (ReplacementOutcome(), "True", "AllCardsHealthy"),
        (ReplacementOutcome(waiting=(make_fault(),)), "False", "CardUnhealthy"),
        (ReplacementOutcome(evicted=(make_fault(),)), "False", "ReplacingReplica"),
        (ReplacementOutcome(in_flight=(make_fault(),)), "False", "ReplacingReplica"),
        (ReplacementOutcome(failed=((make_fault(), "500 Boom"),)), "False", "ReplacingReplica"),
        (
            ReplacementOutcome(blocked=(make_fault(),), evicted=(make_fault("b"),)),
            "False",
            "WaitingForDisruptionBudget",
        ),
    ],
)
def test_replicas_healthy_condition(outcome: ReplacementOutcome, status: str, reason: str) -> None:
    condition = replicas_condition(outcome)
    assert (condition.type, condition.status, condition.reason) == ("ReplicasHealthy", status, reason)


def test_the_429_path_says_the_budget_is_exhausted_naming_node_and_card() -> None:
    message = replicas_condition(ReplacementOutcome(blocked=(make_fault(),))).message
    assert message == (
        "cannot evict pod qwen-1 on node xpu-1 (card 5) yet: the PodDisruptionBudget allows no "
        "disruption now; retrying every 5s"
    )


def _reconcile(outcome: ReplacementOutcome, previous: dict[str, Any] | None = None) -> Any:
    return reconcile(
        make_ref(), parse_spec_or_error(make_raw_spec()), previous, make_facts(replacements=outcome), now=NOW
    )


def test_reconcile_counts_replacements_and_posts_the_waiting_events_once() -> None:
    waiting = _reconcile(ReplacementOutcome(waiting=(make_fault(),), recheck_after_seconds=20.0))
    assert [(e.reason, e.message) for e in waiting.events] == [
        (
            "CardUnhealthy",
            "pod qwen-1 on node xpu-1 (card 5): XpuUnhealthy ecc; replaced after 120s unhealthy",
        )
    ]
    assert (waiting.status["replicaReplacements"], waiting.requeue_after_seconds) == (0, 20.0)
    again = _reconcile(ReplacementOutcome(waiting=(make_fault(),)), waiting.status)
    assert again.events == ()  # still the same state: no new event

    blocked = _reconcile(
        ReplacementOutcome(blocked=(make_fault(),), recheck_after_seconds=5.0), waiting.status
    )
    assert [e.reason for e in blocked.events] == ["WaitingForDisruptionBudget"]
    assert blocked.status["replicaReplacements"] == 0
    assert _reconcile(ReplacementOutcome(blocked=(make_fault(),)), blocked.status).events == ()

    evicted = _reconcile(ReplacementOutcome(evicted=(make_fault(),)), blocked.status)
    assert evicted.events == ()  # ReplacingReplica is posted by the controller when the API accepts
    assert evicted.status["replicaReplacements"] == 1
    assert evicted.status["lastReplacement"] == {
        "pod": "qwen-1",
        "node": "xpu-1",
        "card": "5",
        "reason": "XpuUnhealthy",
        "time": NOW,
    }
    healthy = _reconcile(ReplacementOutcome(), evicted.status)
    assert (healthy.status["replicaReplacements"], healthy.status["lastReplacement"]["pod"]) == (1, "qwen-1")
    assert {c["type"]: c["reason"] for c in healthy.status["conditions"]}[
        "ReplicasHealthy"
    ] == "AllCardsHealthy"


def test_a_failed_spec_keeps_the_count() -> None:
    plan = reconcile(
        make_ref(), parse_spec_or_error({"model": {}}), {"replicaReplacements": 2}, make_facts(), now=NOW
    )
    assert plan.status["replicaReplacements"] == 2


def test_pod_facts_carry_the_fault() -> None:
    assert PodFacts("p", "xpu-1", uid="u", fault=make_fault()).fault == make_fault()


# --- spec.faultTolerance.replaceAfter -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"), [(None, 120), ("0s", 0), ("45s", 45), ("2m", 120), ("1h2m3s", 3723)]
)
def test_replace_after_parses_durations(text: str | None, seconds: int) -> None:
    overrides = {} if text is None else {"faultTolerance": {"replaceAfter": text}}
    assert parse_spec(make_raw_spec(**overrides)).fault_tolerance.replace_after_seconds == seconds


def test_parse_time_reads_rfc3339_and_rejects_garbage() -> None:
    assert parse_time("2026-01-01T00:00:00Z") == T0
    assert parse_time("yesterday") is None
    assert parse_time(None) is None


def test_the_pod_watch_wakes_a_service_only_for_what_it_depends_on() -> None:
    pod = make_pod()
    restarted = make_pod()
    restarted["status"]["containerStatuses"] = [{"name": "runtime", "restartCount": 3, "ready": False}]
    assert _pod_fingerprint(pod) == _pod_fingerprint(restarted) == ("xpu-1", False, None, None, None, None)
    assert _pod_fingerprint(make_pod(condition=ECC)) == (
        "xpu-1",
        False,
        ("5", "XpuUnhealthy", T0),
        None,
        None,
        None,
    )
    assert _pod_fingerprint(make_pod(terminating=True)) == ("xpu-1", True, None, None, None, None)

"""The readiness gate nobody reports on: facts from a pod, when the operator opens it, what it says.

Virtual time throughout: the pods carry their containers' ready time and every decision takes
``now``, so "the grace period passed" is a later ``now``, never a wait.
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from kunlun_operator import names
from kunlun_operator.decide.health_gate import (
    GatedPod,
    GateOutcome,
    gate_condition,
    gated_pod,
    health_reported_condition,
    plan_gates,
)
from kunlun_operator.decide.reconcile import PodFacts, reconcile
from kunlun_operator.decide.status import Condition
from kunlun_operator.shell.handlers import _pod_fingerprint
from kunlun_operator.spec.service import parse_spec_or_error
from tests.unit.operator.factories import NOW, make_facts, make_raw_spec, make_ref

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
GRACE = 120.0
PLUGIN_TRUE = {"status": "True", "reason": "XpuHealthy", "message": "node xpu-1: healthy: xpu0"}
PLUGIN_FALSE = {"status": "False", "reason": "XpuUnhealthy", "message": "node xpu-1: xpu0 (KL-0): ecc"}
OURS = {"status": "True", "reason": "NoHealthReporter", "message": "set by kunlun-operator"}


def make_pod(
    name: str = "qwen-1",
    *,
    gate: bool = True,
    phase: str = "Running",
    containers_ready: bool = True,
    health: dict[str, str] | None = None,
    terminating: bool = False,
    unhealthy: tuple[str, ...] = (),
) -> dict[str, Any]:
    """A runtime pod as the API lists it: ready containers since T0, the gate's condition as given,
    the cards ``unhealthy`` reported Unhealthy by the kubelet (``allocatedResourcesStatus``)."""
    meta: dict[str, Any] = {"name": name, "uid": f"uid-{name}", "resourceVersion": "7"}
    if terminating:
        meta["deletionTimestamp"] = NOW
    conditions: list[dict[str, Any]] = [
        {"type": "Initialized", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"},
        {
            "type": "ContainersReady",
            "status": "True" if containers_ready else "False",
            "lastTransitionTime": "2026-01-01T00:00:00Z",
        },
        {"type": "Ready", "status": "False", "reason": "ReadinessGatesNotReady"},
    ]
    if health is not None:
        conditions.append({"type": names.XPU_HEALTHY_CONDITION, **health})
    spec: dict[str, Any] = {"nodeName": "xpu-1", "containers": []}
    if gate:
        spec["readinessGates"] = [{"conditionType": names.XPU_HEALTHY_CONDITION}]
    status: dict[str, Any] = {"phase": phase, "conditions": conditions}
    if unhealthy:
        resources = [{"resourceID": card, "health": "Unhealthy"} for card in unhealthy]
        resources.append({"resourceID": "xpu9", "health": "Healthy"})
        status["containerStatuses"] = [
            {
                "name": "runtime",
                "allocatedResourcesStatus": [{"name": names.RESOURCE_NAME, "resources": resources}],
            }
        ]
    return {"metadata": meta, "spec": spec, "status": status}


def gated(**kwargs: Any) -> GatedPod:
    pod = gated_pod(make_pod(**kwargs))
    assert pod is not None
    return pod


def at(seconds: float) -> datetime.datetime:
    return T0 + datetime.timedelta(seconds=seconds)


def names_of(pods: tuple[GatedPod, ...]) -> list[str]:
    return [p.name for p in pods]


def test_a_pod_is_read_for_its_gate() -> None:
    pod = gated(health=PLUGIN_TRUE)
    assert (pod.name, pod.uid, pod.node, pod.resource_version) == ("qwen-1", "uid-qwen-1", "xpu-1", "7")
    assert (pod.containers_ready, pod.ready_since, pod.health) == (True, T0, ("True", "XpuHealthy"))
    assert [c["type"] for c in pod.conditions] == [
        "Initialized",
        "ContainersReady",
        "Ready",
        names.XPU_HEALTHY_CONDITION,
    ]
    assert gated_pod(make_pod(gate=False)) is None  # --no-xpu-health-gate: nothing to open
    assert not gated(phase="Pending").containers_ready
    assert not gated(containers_ready=False).containers_ready
    assert not gated(terminating=True).containers_ready
    assert gated().health is None


def test_plugin_down_at_pod_start_the_gate_opens_exactly_when_the_grace_period_ends() -> None:
    early = plan_gates([gated()], now=at(119), grace_seconds=GRACE)
    assert (names_of(early.open), names_of(early.waiting), early.recheck_after_seconds) == (
        [],
        ["qwen-1"],
        1.0,
    )
    due = plan_gates([gated()], now=at(120), grace_seconds=GRACE)
    assert (names_of(due.open), due.waiting, due.recheck_after_seconds) == (["qwen-1"], (), None)


def test_a_verdict_of_the_plugin_is_never_touched_true_or_false_however_late() -> None:
    for verdict in (PLUGIN_TRUE, PLUGIN_FALSE):
        plan = plan_gates([gated(health=verdict)], now=at(10_000), grace_seconds=GRACE)
        assert (plan.open, plan.waiting, plan.opened, plan.recheck_after_seconds) == ((), (), (), None)


def test_a_gate_the_operator_opened_is_reported_and_not_opened_again() -> None:
    plan = plan_gates([gated(health=OURS)], now=at(10_000), grace_seconds=GRACE)
    assert (plan.open, names_of(plan.opened)) == ((), ["qwen-1"])


def test_pods_not_ready_for_other_reasons_are_left_to_their_probes() -> None:
    pods = [gated(phase="Pending"), gated(containers_ready=False), gated(terminating=True)]
    plan = plan_gates(pods, now=at(10_000), grace_seconds=GRACE)
    assert (plan.open, plan.waiting) == ((), ())


def test_a_pod_whose_card_the_kubelet_reports_unhealthy_is_never_opened() -> None:
    # plugin up (its ListAndWatch marked xpu0 Unhealthy) but its pods/status patch was denied
    bad = gated(unhealthy=("xpu0",))
    assert bad.unhealthy_cards == ("xpu0",)
    assert gated().unhealthy_cards == ()
    plan = plan_gates([bad, gated(name="qwen-2")], now=at(10_000), grace_seconds=GRACE)
    assert (names_of(plan.open), names_of(plan.held), plan.waiting) == (["qwen-2"], ["qwen-1"], ())
    condition = health_reported_condition(GateOutcome(held=plan.held))
    assert condition == Condition(
        "CardHealthReported",
        "False",
        "NoHealthReporter",
        "pod qwen-1 on node xpu-1 has no card health report but the kubelet reports its card xpu0 "
        "Unhealthy: the operator does not set its gate and the pod stays NotReady (the device plugin "
        "runs but its verdict did not reach the pod: check its right to patch pods/status)",
    )


def test_a_grace_of_zero_never_opens_and_never_rechecks() -> None:
    plan = plan_gates([gated()], now=at(10_000), grace_seconds=0)
    assert (plan.open, names_of(plan.waiting), plan.recheck_after_seconds) == ((), ["qwen-1"], None)


def test_the_wait_counts_from_the_earlier_of_ready_time_and_first_sighting() -> None:
    # kubelet re-dated ContainersReady (a probe flapped) after the operator first saw the pod waiting
    plan = plan_gates([gated()], now=at(100), grace_seconds=GRACE, first_seen={"uid-qwen-1": at(-20)})
    assert names_of(plan.open) == ["qwen-1"]
    several = plan_gates(
        [gated(name="b"), gated(name="a")], now=at(30), grace_seconds=GRACE, first_seen={"uid-b": at(-60)}
    )
    assert (names_of(several.waiting), several.recheck_after_seconds) == (["a", "b"], 30.0)


def test_the_condition_the_operator_writes_is_true_with_its_reason() -> None:
    assert gate_condition(NOW, GRACE) == {
        "type": "kunlun.dev/xpu-healthy",
        "status": "True",
        "reason": "NoHealthReporter",
        "message": "set by kunlun-operator: no device plugin reported this pod's card health within 120s "
        "of its containers becoming ready; its cards are not monitored",
        "lastTransitionTime": NOW,
    }


@pytest.mark.parametrize(
    ("outcome", "gate", "expected"),
    [
        (GateOutcome(), True, ("True", "HealthReported")),
        (GateOutcome(), False, ("Unknown", "GateOff")),
        (GateOutcome(waiting=(gated(),)), True, ("False", "AwaitingHealthReport")),
        (GateOutcome(waiting=(gated(),), opened=(gated(name="q2"),)), True, ("False", "NoHealthReporter")),
        (GateOutcome(failed=((gated(), "403 Forbidden"),)), True, ("False", "NoHealthReporter")),
    ],
)
def test_the_service_says_whether_card_health_is_reported(
    outcome: GateOutcome, gate: bool, expected: tuple[str, str]
) -> None:
    condition = health_reported_condition(outcome, gate=gate)
    assert (condition.type, condition.status, condition.reason) == ("CardHealthReported", *expected)


def test_the_service_condition_names_the_pods_and_what_to_check() -> None:
    outcome = GateOutcome(
        waiting=(gated(name="qwen-3"),),
        opened=(gated(name="qwen-1"),),
        failed=((gated(name="qwen-2"), "403 Forbidden"),),
    )
    assert health_reported_condition(outcome) == Condition(
        "CardHealthReported",
        "False",
        "NoHealthReporter",
        "no device plugin reports the card health of pod qwen-1 on node xpu-1: the operator set its gate "
        "(reason NoHealthReporter) and its cards are not monitored; pod qwen-2 on node xpu-1 has no card "
        "health report and the operator could not set its gate (403 Forbidden; it needs patch on "
        "pods/status); waiting for a device plugin to report the card health of pod qwen-3 on node "
        "xpu-1; the operator sets it after 120s",
    )
    never = health_reported_condition(GateOutcome(grace_seconds=0, waiting=(gated(),)))
    assert never.message.endswith(
        "the operator never sets it (grace 0): the pod stays NotReady until one does"
    )


def test_reconcile_reports_the_gates_and_wakes_when_the_first_is_due() -> None:
    facts = make_facts(gates=GateOutcome(waiting=(gated(),), recheck_after_seconds=42.0))
    plan = reconcile(make_ref(), parse_spec_or_error(make_raw_spec()), None, facts, now=NOW)
    [cond] = [c for c in plan.status["conditions"] if c["type"] == "CardHealthReported"]
    assert (cond["status"], cond["reason"], plan.requeue_after_seconds) == (
        "False",
        "AwaitingHealthReport",
        42.0,
    )
    off = reconcile(
        make_ref(), parse_spec_or_error(make_raw_spec()), None, make_facts(xpu_health_gate=False), now=NOW
    )
    assert [c["reason"] for c in off.status["conditions"] if c["type"] == "CardHealthReported"] == ["GateOff"]
    failed = reconcile(make_ref(), parse_spec_or_error(make_raw_spec(versions={})), None, facts, now=NOW)
    assert [c["status"] for c in failed.status["conditions"] if c["type"] == "CardHealthReported"] == [
        "Unknown"
    ]


def test_the_pod_watch_wakes_the_service_when_the_gates_facts_change() -> None:
    waiting, reported = make_pod(), make_pod(health=PLUGIN_TRUE)
    assert _pod_fingerprint(waiting) != _pod_fingerprint(make_pod(containers_ready=False))
    assert _pod_fingerprint(waiting) != _pod_fingerprint(reported)
    assert _pod_fingerprint(reported) != _pod_fingerprint(make_pod(health=OURS))
    assert PodFacts("qwen-1", "xpu-1", gate=gated()).gate == gated()

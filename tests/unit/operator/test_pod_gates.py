"""The shell that opens readiness gates: the guarded pods/status write, events, metrics, races."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from kunlun_operator.errors import ApiError
from kunlun_operator.shell.kube import POD
from kunlun_operator.shell.metrics import OperatorMetrics
from kunlun_operator.shell.pod_gates import GateOpener, service_reference
from kunlun_operator.spec.service import parse_service_ref
from tests.unit.operator.factories import make_ref
from tests.unit.operator.test_health_gate import PLUGIN_TRUE, gated

BEFORE = "2026-01-01T00:01:59Z"  # 119 s after the containers became ready (T0)
DUE = "2026-01-01T00:02:00Z"


class StatusClient:
    """Answers ``patch`` with the statuses queued per pod (None: accepted), like ``KubeClient``."""

    def __init__(self, answers: dict[str, list[int | None]] | None = None) -> None:
        self.answers = answers or {}
        self.patches: list[tuple[str, str, str, dict[str, Any], str | None]] = []

    def patch(
        self,
        kind: Any,
        namespace: str,
        name: str,
        patch: Mapping[str, Any],
        *,
        subresource: str | None = None,
    ) -> None:
        self.patches.append((kind.kind, namespace, name, dict(patch), subresource))
        status = self.answers.get(name, [None]).pop(0)
        if status is not None:
            reason = {403: "Forbidden", 409: "Conflict"}.get(status, "InternalError")
            raise ApiError(status, reason, "no", call=f"PATCH {name}")


def opener(client: StatusClient, events: list[tuple[str, str, str, str]]) -> GateOpener:
    def post_event(body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        events.append((body["kind"], body["metadata"]["name"], type_, reason))

    return GateOpener(client, OperatorMetrics(), post_event, grace_seconds=120)  # type: ignore[arg-type]


def sample(gates: GateOpener, name: str) -> float | None:
    return gates.metrics.registry.get_sample_value(name)


def test_an_overdue_gate_is_set_with_the_read_conditions_and_resource_version_and_announced() -> None:
    client, events = StatusClient(), []
    gates = opener(client, events)
    waiting = gates.open_gates(make_ref(), [gated()], BEFORE)
    assert (client.patches, [p.name for p in waiting.waiting], waiting.recheck_after_seconds) == (
        [],
        ["qwen-1"],
        1.0,
    )

    done = gates.open_gates(make_ref(), [gated()], DUE)
    [(kind, namespace, name, patch, subresource)] = client.patches
    assert (kind, namespace, name, subresource) == (POD.kind, "ml", "qwen-1", "status")
    assert patch["metadata"] == {"resourceVersion": "7"}
    conditions = patch["status"]["conditions"]
    assert [c["type"] for c in conditions] == [
        "Initialized",
        "ContainersReady",
        "Ready",
        "kunlun.dev/xpu-healthy",
    ]
    assert (conditions[-1]["status"], conditions[-1]["reason"]) == ("True", "NoHealthReporter")
    assert [p.name for p in done.opened] == ["qwen-1"]
    assert events == [
        ("Pod", "qwen-1", "Warning", "NoHealthReporter"),
        ("KunlunInferenceService", "qwen", "Warning", "NoHealthReporter"),
    ]
    assert sample(gates, "kunlun_operator_health_gates_opened_total") == 1.0
    assert sample(gates, "kunlun_operator_unmonitored_pods") == 1.0


def test_the_plugins_late_verdict_stops_the_countdown_and_a_race_is_lost_quietly() -> None:
    client, events = StatusClient({"qwen-1": [409]}), []
    gates = opener(client, events)
    raced = gates.open_gates(make_ref(), [gated()], DUE)  # the plugin wrote since the listing
    assert (raced.opened, raced.failed, events, raced.recheck_after_seconds) == ((), (), [], 10.0)
    reported = gates.open_gates(make_ref(), [gated(health=PLUGIN_TRUE)], DUE)
    assert (reported.opened, reported.waiting, len(client.patches)) == ((), (), 1)
    assert sample(gates, "kunlun_operator_health_gates_opened_total") == 0.0


def test_a_denied_write_is_reported_and_retried_never_turned_false() -> None:
    client, events = StatusClient({"qwen-1": [403, None]}), []
    gates = opener(client, events)
    denied = gates.open_gates(make_ref(), [gated()], DUE)
    assert ([(p.name, e) for p, e in denied.failed], denied.recheck_after_seconds, events) == (
        [("qwen-1", "403 Forbidden")],
        10.0,
        [("KunlunInferenceService", "qwen", "Warning", "CannotSetHealthGate")],
    )
    again = gates.open_gates(make_ref(), [gated()], DUE)
    assert [p.name for p in again.opened] == ["qwen-1"]
    assert {
        c["status"] for _, _, _, patch, _ in client.patches for c in patch["status"]["conditions"][-1:]
    } == {"True"}


def test_a_denied_write_is_announced_once_per_pod_and_error_until_it_changes_or_succeeds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = StatusClient({"qwen-1": [403, 403, 403, 500, None, 403], "qwen-2": [403]})
    events: list[tuple[str, str, str, str]] = []
    gates = opener(client, events)
    announced = ("KunlunInferenceService", "qwen", "Warning", "CannotSetHealthGate")
    with caplog.at_level("WARNING", logger="kunlun_operator.shell.pod_gates"):
        for _ in range(3):  # the retries every 10 s meet the same 403
            gates.open_gates(make_ref(), [gated()], DUE)
        assert events == [announced]
        assert [r.getMessage() for r in caplog.records] == [
            "ml/qwen: pod qwen-1 on node xpu-1 has no card health report and the operator could not set "
            "its gate (403 Forbidden; it needs patch on pods/status) (retried every 10s): "
            "PATCH qwen-1: 403 Forbidden: no"
        ]
        gates.open_gates(make_ref(), [gated()], DUE)  # a new error is news
        assert (events[1:], len(caplog.records)) == ([announced], 2)
        gates.open_gates(make_ref(), [gated()], DUE)  # granted: the gate opens
        assert [e[3] for e in events[2:]] == ["NoHealthReporter", "NoHealthReporter"]
        gates.open_gates(make_ref(), [gated(name="qwen-2")], DUE)  # another pod: news too
        gates.open_gates(make_ref(), [gated()], DUE)  # after a success, a failure is news
    assert (events[4:], len(caplog.records)) == ([announced, announced], 5)


def test_a_gate_opened_earlier_counts_until_the_plugin_writes_and_a_deleted_service_is_forgotten() -> None:
    gates = opener(StatusClient(), [])
    gates.open_gates(make_ref(), [gated(health={"status": "True", "reason": "NoHealthReporter"})], DUE)
    assert sample(gates, "kunlun_operator_unmonitored_pods") == 1.0
    gates.open_gates(make_ref(), [gated(health=PLUGIN_TRUE)], DUE)
    assert sample(gates, "kunlun_operator_unmonitored_pods") == 0.0
    gates.open_gates(make_ref(), [gated(health={"status": "True", "reason": "NoHealthReporter"})], DUE)
    gates.forget("ml", "qwen")
    assert sample(gates, "kunlun_operator_unmonitored_pods") == 0.0


def test_events_about_the_service_reference_it_as_kopf_references_the_whole_object() -> None:
    from kopf._cogs.structs.bodies import Body, build_object_reference

    body = {
        "apiVersion": "serving.kunlun.dev/v1alpha1",
        "kind": "KunlunInferenceService",
        "metadata": {
            "name": "qwen",
            "namespace": "ml",
            "uid": "uid-1",
            "generation": 2,
            "resourceVersion": "9",
        },
        "spec": {"replicas": 2},
        "status": {"phase": "Ready"},
    }
    reference = service_reference(parse_service_ref(body))
    assert reference == {
        "apiVersion": "serving.kunlun.dev/v1alpha1",
        "kind": "KunlunInferenceService",
        "metadata": {"name": "qwen", "namespace": "ml", "uid": "uid-1"},
    }
    assert build_object_reference(Body(reference)) == build_object_reference(Body(body))

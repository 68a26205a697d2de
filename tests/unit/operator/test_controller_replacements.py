"""The shell around the replacement decision: Eviction calls, 429 handling, metric, memory."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kunlun_operator.decide.reconcile import PodFacts
from kunlun_operator.decide.replicas import CardFault, parse_time
from kunlun_operator.errors import ApiError
from kunlun_operator.shell.controller import Controller, ControllerConfig
from kunlun_operator.shell.metrics import OperatorMetrics
from kunlun_operator.spec.service import parse_spec_or_error
from tests.unit.operator.factories import make_raw_spec, make_ref


class EvictingClient:
    """Answers ``evict`` with the statuses queued per pod (None: accepted), like ``KubeClient``."""

    def __init__(self, answers: dict[str, list[int | None]]) -> None:
        self.answers = answers
        self.evictions: list[tuple[str, str, str | None]] = []

    def evict(self, namespace: str, name: str, *, uid: str | None = None) -> None:
        self.evictions.append((namespace, name, uid))
        status = self.answers.get(name, [None]).pop(0)
        if status is not None:
            raise ApiError(status, "TooManyRequests", "budget", call=f"POST {name}/eviction")


def _pod(name: str, since: str | None = "2026-01-01T00:00:00Z") -> PodFacts:
    fault = CardFault(
        name, f"uid-{name}", "xpu-1", "5", "XpuUnhealthy", "ecc", "condition", parse_time(since)
    )
    return PodFacts(name, "xpu-1", uid=f"uid-{name}", fault=fault)


def _controller(client: EvictingClient, events: list[tuple[str, str, str]] | None = None) -> Controller:
    def post_event(_body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        if events is not None:
            events.append((type_, reason, message))

    return Controller(client, ControllerConfig(), OperatorMetrics(), post_event)  # type: ignore[arg-type]


def _count(controller: Controller, reason: str = "XpuUnhealthy") -> float | None:
    return controller.metrics.registry.get_sample_value(
        "kunlun_operator_replica_replacements_total", {"reason": reason}
    )


def test_429_waits_for_the_budget_then_201_replaces_once() -> None:
    client = EvictingClient({"qwen-1": [429, None]})
    controller = _controller(client)
    spec = make_raw_spec(faultTolerance={"replaceAfter": "10s"})
    early = controller.replace_replicas(
        make_ref(), parse_spec_or_error(spec), [_pod("qwen-1")], "2026-01-01T00:00:05Z"
    )
    assert (client.evictions, [f.pod for f in early.waiting], early.recheck_after_seconds) == (
        [],
        ["qwen-1"],
        5.0,
    )

    blocked = controller.replace_replicas(
        make_ref(), parse_spec_or_error(spec), [_pod("qwen-1")], "2026-01-01T00:00:10Z"
    )
    assert ([f.pod for f in blocked.blocked], blocked.evicted, blocked.recheck_after_seconds) == (
        ["qwen-1"],
        (),
        5.0,
    )
    assert _count(controller) is None

    done = controller.replace_replicas(
        make_ref(), parse_spec_or_error(spec), [_pod("qwen-1")], "2026-01-01T00:00:15Z"
    )
    assert [f.pod for f in done.evicted] == ["qwen-1"]
    assert client.evictions == [("ml", "qwen-1", "uid-qwen-1")] * 2
    assert _count(controller) == 1.0

    # A stale listing still shows the pod: it is in flight, never evicted twice.
    stale = controller.replace_replicas(
        make_ref(), parse_spec_or_error(spec), [_pod("qwen-1")], "2026-01-01T00:00:20Z"
    )
    assert ([f.pod for f in stale.in_flight], len(client.evictions)) == (["qwen-1"], 2)


def test_other_errors_are_retried_and_a_vanished_pod_is_no_failure() -> None:
    client = EvictingClient({"a": [500], "b": [404]})
    controller = _controller(client)
    out = controller.replace_replicas(
        make_ref(), parse_spec_or_error(make_raw_spec()), [_pod("a"), _pod("b")], "2026-01-01T00:02:00Z"
    )
    assert ([(f.pod, e) for f, e in out.failed], out.evicted, out.blocked) == (
        [("a", "500 TooManyRequests")],
        (),
        (),
    )
    assert out.recheck_after_seconds == 5.0


def test_an_undated_fault_waits_replace_after_from_its_first_sighting() -> None:
    client = EvictingClient({})
    controller = _controller(client)
    spec = make_raw_spec(faultTolerance={"replaceAfter": "30s"})
    pods = [_pod("a", since=None)]
    assert (
        controller.replace_replicas(
            make_ref(), parse_spec_or_error(spec), pods, "2026-01-01T00:10:00Z"
        ).recheck_after_seconds
        == 30.0
    )
    assert (
        controller.replace_replicas(
            make_ref(), parse_spec_or_error(spec), pods, "2026-01-01T00:10:29Z"
        ).evicted
        == ()
    )
    assert [
        f.pod
        for f in controller.replace_replicas(
            make_ref(), parse_spec_or_error(spec), pods, "2026-01-01T00:10:30Z"
        ).evicted
    ] == ["a"]


def test_a_node_agent_restart_that_redates_the_fault_does_not_restart_the_countdown() -> None:
    client = EvictingClient({})
    controller = _controller(client)
    spec = make_raw_spec(faultTolerance={"replaceAfter": "30s"})
    first = controller.replace_replicas(
        make_ref(),
        parse_spec_or_error(spec),
        [_pod("a", since="2026-01-01T00:10:00Z")],
        "2026-01-01T00:10:00Z",
    )
    assert first.recheck_after_seconds == 30.0
    redated = [_pod("a", since="2026-01-01T00:10:20Z")]  # the agent restarted, wrote the condition anew
    assert (
        controller.replace_replicas(
            make_ref(), parse_spec_or_error(spec), redated, "2026-01-01T00:10:29Z"
        ).evicted
        == ()
    )
    due = controller.replace_replicas(make_ref(), parse_spec_or_error(spec), redated, "2026-01-01T00:10:30Z")
    assert [f.pod for f in due.evicted] == ["a"]


def test_an_invalid_spec_replaces_nothing() -> None:
    client = EvictingClient({})
    out = _controller(client).replace_replicas(
        make_ref(), parse_spec_or_error({"model": {}}), [_pod("a")], "2026-01-01T01:00:00Z"
    )
    assert (out.evicted, client.evictions) == ((), [])


def test_the_replacing_replica_event_is_posted_as_soon_as_the_eviction_is_accepted() -> None:
    events: list[tuple[str, str, str]] = []
    client = EvictingClient({"a": [429, None]})
    controller = _controller(client, events)
    spec = make_raw_spec(faultTolerance={"replaceAfter": "30s"})
    controller.replace_replicas(make_ref(), parse_spec_or_error(spec), [_pod("a")], "2026-01-01T00:01:00Z")
    assert events == []  # 429: nothing replaced yet
    controller.replace_replicas(make_ref(), parse_spec_or_error(spec), [_pod("a")], "2026-01-01T00:01:05Z")
    assert events == [
        (
            "Warning",
            "ReplacingReplica",
            "evicting pod a on node xpu-1 (card 5): the card has been unhealthy for 30s or more (XpuUnhealthy: ecc)",
        )
    ]

"""Health checks, severity classes, and recovery after the clear period (virtual clock)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kunlun_device.errors import ConfigError
from kunlun_device.xpu.health import Check, Finding, HealthPolicy, Severity, evaluate, parse_severities
from kunlun_device.xpu.health_tracker import HealthState, HealthTracker, Transition
from kunlun_device.xpu.monitor import HealthMonitor
from tests.unit.device.hosts import copy_host, make_source, use_outputs

H, U = HealthState.HEALTHY, HealthState.UNHEALTHY


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_failing_node_findings_by_severity() -> None:
    source = make_source("p800-failing")
    devices = make_source("p800-8").list_devices()
    findings = evaluate(devices, source.telemetry(), None, source.device_node_present, HealthPolicy())
    assert {i: f for i, f in findings.items() if f} == {
        2: (Finding(2, Check.TEMPERATURE_HIGH, Severity.WARN, "88C >= 85C"),),
        5: (Finding(5, Check.ECC_UNCORRECTABLE, Severity.UNHEALTHY, "3 uncorrectable ECC errors"),),
        6: (Finding(6, Check.DEVICE_NODE_MISSING, Severity.UNHEALTHY, "/dev/xpu6 does not exist"),),
    }


def test_policy_can_ignore_or_escalate_checks() -> None:
    source = make_source("p800-failing")
    devices = make_source("p800-8").list_devices()
    severities = parse_severities("ecc-uncorrectable=ignore, temperature-high=unhealthy")
    policy = HealthPolicy(severities=severities, temperature_warn_celsius=80, temperature_critical_celsius=90)
    findings = evaluate(devices, source.telemetry(), None, source.device_node_present, policy)
    assert findings[2] == (Finding(2, Check.TEMPERATURE_HIGH, Severity.UNHEALTHY, "88C >= 80C"),)
    assert findings[5] == ()


def test_tool_failure_is_a_finding_for_every_card() -> None:
    source = make_source("p800-8")
    devices = source.list_devices()
    findings = evaluate(devices, None, "xpu-smi: exit status 9", source.device_node_present, HealthPolicy())
    assert findings[3] == (Finding(3, Check.TOOL_ERROR, Severity.WARN, "xpu-smi: exit status 9"),)
    assert len({f for fs in findings.values() for f in fs}) == 8


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("ecc=warn", "--health-policy: unknown check 'ecc' (known: device-node-missing,"),
        ("tool-error=fatal", "--health-policy: unknown severity 'fatal' (known: ignore, warn, unhealthy)"),
        ("tool-error", "--health-policy: entry 'tool-error' is not check=severity"),
    ],
)
def test_bad_policy_names_the_flag(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_severities(text)
    assert str(caught.value).startswith(message)


def test_card_recovers_only_after_clear_period(caplog: pytest.LogCaptureFixture) -> None:
    devices = make_source("p800-8").list_devices()[:2]
    clock = FakeClock()
    tracker = HealthTracker(devices, recovery_seconds=30, clock=clock)
    fault = {1: (Finding(1, Check.ECC_UNCORRECTABLE, Severity.UNHEALTHY, "3 uncorrectable ECC errors"),)}
    caplog.set_level("INFO", logger="kunlun_device.xpu.health_tracker")

    assert tracker.update(fault) == [
        Transition(1, devices[1].uuid, H, U, "ecc-uncorrectable: 3 uncorrectable ECC errors")
    ]
    assert tracker.update(fault) == []  # still failing: no second transition
    clock.now += 10
    assert tracker.update({}) == []  # cleared, the period starts now
    clock.now += 29
    assert tracker.update({}) == []
    assert tracker.states() == {0: H, 1: U}
    clock.now += 1
    assert tracker.update({}) == [
        Transition(1, devices[1].uuid, U, H, "no fault for 30s (recovery period 30s)")
    ]
    assert tracker.transitions_total == {(1, U): 1, (1, H): 1}
    assert [r.getMessage() for r in caplog.records] == [
        f"xpu1 ({devices[1].uuid}) Healthy -> Unhealthy: ecc-uncorrectable: 3 uncorrectable ECC errors",
        f"xpu1 ({devices[1].uuid}) Unhealthy -> Healthy: no fault for 30s (recovery period 30s)",
    ]


def test_fault_during_clear_period_restarts_it() -> None:
    devices = make_source("p800-8").list_devices()[:1]
    clock = FakeClock()
    tracker = HealthTracker(devices, recovery_seconds=30, clock=clock)
    fault = {0: (Finding(0, Check.CARD_MISSING, Severity.UNHEALTHY, "not listed by xpu-smi"),)}
    tracker.update(fault)
    tracker.update({})
    clock.now += 20
    tracker.update(fault)
    clock.now += 20
    assert tracker.update({}) == []
    clock.now += 29
    assert tracker.update({}) == []
    clock.now += 1
    assert [t.after for t in tracker.update({})] == [H]


def test_warn_findings_never_change_state() -> None:
    devices = make_source("p800-8").list_devices()[:1]
    tracker = HealthTracker(devices, recovery_seconds=0)
    warn = {0: (Finding(0, Check.TEMPERATURE_HIGH, Severity.WARN, "88C >= 85C"),)}
    assert tracker.update(warn) == []
    assert tracker.states() == {0: H}
    assert tracker.findings()[0] == warn[0]


def test_monitor_sees_failure_and_recovery_of_a_host(tmp_path: Path) -> None:
    host = copy_host("p800-8", tmp_path)
    source = make_source("p800-8", tmp_path)
    clock = FakeClock()
    monitor = HealthMonitor(source, source.list_devices(), HealthPolicy(recovery_seconds=5), clock=clock)
    assert monitor.poll().transitions == ()
    use_outputs(host, "p800-failing")
    snapshot = monitor.poll()
    assert [(t.index, t.after) for t in snapshot.transitions] == [(5, U), (6, U)]
    assert snapshot.states == {0: H, 1: H, 2: H, 3: H, 4: H, 5: U, 6: U, 7: H}
    (host / "outputs" / "table.exit").write_text("9\n")
    snapshot = monitor.poll()
    assert (snapshot.table, monitor.tool_errors_total) == (None, 1)
    assert snapshot.transitions == ()  # tool errors only warn by default; /dev/xpu6 still missing
    use_outputs(host, "p800-8")
    (host / "outputs" / "table.exit").unlink()
    assert monitor.poll().transitions == ()
    clock.now += 5
    assert [(t.index, t.after) for t in monitor.poll().transitions] == [(5, H), (6, H)]

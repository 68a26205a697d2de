"""What the fault response persists: the Node's failure-history annotation, the plugin's state file,
and how `QuarantineLedger` takes a malformed annotation (logged once, ignored, never a crash)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from kunlun_device.errors import FaultStateError
from kunlun_device.faults.history import format_failures, parse_failures
from kunlun_device.faults.ledger import QuarantineLedger
from kunlun_device.faults.quarantine import QuarantinePolicy, prune_history
from kunlun_device.faults.state import FaultState, dump_state, read_state_file, write_state_file
from kunlun_device.labels import FAILURES_ANNOTATION, QUARANTINE_ANNOTATION

NOW = 1_796_094_000.0  # 2026-12-01T03:00:00Z
CARDS = {"GPU-0": 0, "GPU-1": 1}


# --- the failure-history annotation -------------------------------------------------------------


def test_history_round_trip_is_compact_and_sorted() -> None:
    value = format_failures({"GPU-1": (NOW,), "GPU-0": (NOW - 20.5, NOW - 10.25)})
    assert value == ('{"failures":{"GPU-0":[1796093979.5,1796093989.75],"GPU-1":[1796094000.0]},"version":1}')
    assert parse_failures(value) == {"GPU-0": (NOW - 20.5, NOW - 10.25), "GPU-1": (NOW,)}
    assert format_failures({}) is None  # removes the annotation
    assert parse_failures(None) == {}


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("3 failures", "not JSON"),
        ('["GPU-0"]', "not a JSON object"),
        ('{"version":2,"failures":{}}', "version is 2, expected 1"),
        ('{"version":1}', "fields ['version'], expected ['failures', 'version']"),
        ('{"version":1,"failures":[]}', "failures is not an object"),
        ('{"version":1,"failures":{"GPU 0":[1]}}', "failures: 'GPU 0' is not a card UUID"),
        ('{"version":1,"failures":{"GPU-0":1}}', "failures.GPU-0: expected a list of at most 64 times"),
        ('{"version":1,"failures":{"GPU-0":["yesterday"]}}', "failures.GPU-0: 'yesterday' is not a time"),
        ('{"version":1,"failures":{"GPU-0":[-1]}}', "failures.GPU-0: -1 is not a time"),
        ('{"version":1,"failures":{"GPU-0":[true]}}', "failures.GPU-0: True is not a time"),
    ],
)
def test_malformed_history_names_what_is_wrong(value: str, reason: str) -> None:
    with pytest.raises(FaultStateError) as caught:
        parse_failures(value)
    assert caught.value.source == FAILURES_ANNOTATION
    assert caught.value.reason.startswith(reason)


# --- the state file -------------------------------------------------------------------------------


def test_state_file_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    state = FaultState(
        quarantined=frozenset({"GPU-1", "GPU-5"}),
        unwritten_quarantine=frozenset({"GPU-5"}),
        failures={"GPU-0": (NOW - 10,)},
        unwritten_failures={"GPU-0": (NOW - 10,)},
        node_read=True,
        api_errors={"get_node": 2},
        pods_unwritten=1,
    )
    write_state_file(path, dump_state(state))
    assert path.stat().st_mode & 0o777 == 0o644
    assert read_state_file(path) == state
    with pytest.raises(FaultStateError, match="missing"):
        read_state_file(tmp_path / "none.json")


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"format": 2}, "format is 2, expected 1"),
        ({"node_read": "yes"}, "node_read is not true or false"),
        ({"quarantined": "GPU-1"}, "quarantined is not a list of card UUIDs"),
        ({"unwritten_failures": {"GPU-0": "now"}}, "unwritten_failures.GPU-0: expected a list"),
        ({"api_errors": {"get_node": -1}}, "api_errors.get_node is -1, expected a count"),
        ({"pods_unwritten": 1.5}, "pods_unwritten is 1.5, expected a count"),
        ({"extra": 1}, "fields ["),
    ],
)
def test_corrupt_state_file_names_the_field(tmp_path: Path, change: dict[str, object], reason: str) -> None:
    data = json.loads(dump_state(FaultState())) | change
    path = tmp_path / "state.json"
    path.write_text(json.dumps(data))
    with pytest.raises(FaultStateError) as caught:
        read_state_file(path)
    assert caught.value.reason.startswith(reason)


# --- the ledger: restarts and malformed annotations -------------------------------------------------


def test_the_nodes_count_plus_a_failure_after_a_restart_quarantines() -> None:
    ledger = QuarantineLedger(CARDS, QuarantinePolicy(3, 600), "n1")
    changes, _ = ledger.sync(
        {FAILURES_ANNOTATION: format_failures({"GPU-0": (NOW - 100, NOW - 50)}) or ""}, NOW
    )
    assert changes == {}  # the Node is right
    assert ledger.record("GPU-0", "ecc", NOW) is True
    changes, _ = ledger.sync({}, NOW)
    assert changes == {QUARANTINE_ANNOTATION: "GPU-0"}  # (its history has served: nothing to remove)


def test_failures_outside_the_window_on_the_node_do_not_count() -> None:
    ledger = QuarantineLedger(CARDS, QuarantinePolicy(3, 600), "n1")
    ledger.sync({FAILURES_ANNOTATION: format_failures({"GPU-0": (NOW - 700, NOW - 650)}) or ""}, NOW)
    assert ledger.record("GPU-0", "ecc", NOW) is False


def test_malformed_annotations_are_logged_once_and_ignored(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kunlun_device.faults")
    ledger = QuarantineLedger(CARDS, QuarantinePolicy(3, 600), "n1")
    annotations = {FAILURES_ANNOTATION: "GPU-0=3", QUARANTINE_ANNOTATION: "GPU-1 GPU-0"}
    for _ in range(3):  # every Node read sees the same values
        changes, readmitted = ledger.sync(annotations, NOW)
        assert (changes, readmitted) == ({}, frozenset())  # nothing to say: the bad value is left alone
    assert ledger.quarantined == frozenset()
    assert [r.getMessage() for r in caplog.records] == [
        "node n1: annotation kunlun.dev/xpu-quarantine: ['GPU-1 GPU-0'] are not card UUIDs "
        "(expected comma-separated UUIDs); ignored",
        "node n1: kunlun.dev/xpu-failures: not JSON (Expecting value: line 1 column 1 (char 0)); ignored",
    ]
    ledger.record("GPU-1", "ecc", NOW)  # a failure to write replaces the malformed history
    changes, _ = ledger.sync(annotations, NOW)
    assert changes == {FAILURES_ANNOTATION: '{"failures":{"GPU-1":[1796094000.0]},"version":1}'}


# --- failure times in the future (a clock stepped back, a hand-edited annotation) ------------------


def test_future_failure_times_are_dropped_beyond_the_slack() -> None:
    policy = QuarantinePolicy(3, 600)
    history = {"GPU-0": (NOW - 10, NOW + 30, NOW + 61), "GPU-1": (NOW + 3600,)}
    assert prune_history(history, NOW, policy) == {"GPU-0": (NOW - 10, NOW + 30)}  # 60 s of drift kept


def test_a_future_time_on_the_node_is_removed_and_never_counts(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kunlun_device.faults")
    ledger = QuarantineLedger(CARDS, QuarantinePolicy(2, 600), "n1")
    annotations = {FAILURES_ANNOTATION: format_failures({"GPU-0": (NOW + 3000,)}) or ""}
    for _ in range(2):  # read again before the removal is written: logged once
        changes, _ = ledger.sync(annotations, NOW)
        assert changes == {FAILURES_ANNOTATION: None}  # removed from the Node
    assert [r.getMessage() for r in caplog.records] == [
        f"node n1: {FAILURES_ANNOTATION}: failure times of GPU-0 later than now (1796094000.000) ignored, "
        "clock stepped back or edited by hand: 1796097000.000"
    ]
    ledger.written()
    ledger.sync({}, NOW + 3000)  # the clock reaches the time: it is not on the Node any more
    assert ledger.record("GPU-0", "ecc", NOW + 3001) is False


def test_failures_counted_before_the_clock_stepped_back_do_not_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kunlun_device.faults")
    ledger = QuarantineLedger(CARDS, QuarantinePolicy(2, 600), "n1")
    assert ledger.record("GPU-0", "ecc", NOW + 1000) is False
    assert ledger.record("GPU-0", "ecc", NOW) is False  # the clock stepped back 1000 s
    assert ledger.state(NOW).unwritten_failures == {"GPU-0": (NOW,)}
    assert len(caplog.records) == 1 and "GPU-0 later than now" in caplog.records[0].getMessage()


def test_future_times_in_the_state_file_are_not_restored() -> None:
    ledger = QuarantineLedger(CARDS, QuarantinePolicy(2, 600), "n1")
    future = {"GPU-0": (NOW + 3000,)}
    ledger.restore(FaultState(failures=future, unwritten_failures=future), NOW, "state.json")
    assert ledger.state(NOW + 3000).failures == {} and not ledger.needs_write
    assert ledger.record("GPU-0", "ecc", NOW + 3001) is False

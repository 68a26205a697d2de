"""The node snapshot format and `SnapshotSource`: round trip, freshness, missing and corrupt files."""

from __future__ import annotations

import json
import stat
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kunlun_device.errors import (
    SnapshotCorruptError,
    SnapshotMissingError,
    SnapshotStaleError,
    XpuError,
    XpuParseError,
)
from kunlun_device.xpu import SnapshotSource, Versions
from kunlun_device.xpu.health import Check, Finding, Severity
from kunlun_device.xpu.health_tracker import HealthState
from kunlun_device.xpu.snapshot import CardHealth, NodeSnapshot, dump_snapshot, parse_snapshot, write_snapshot
from tests.unit.device.hosts import copy_host, make_source

NOW = 1_800_000_000.0


def make_snapshot(
    host: str = "p800-8", base: Path | None = None, interval_seconds: float = 10.0
) -> NodeSnapshot:
    """What the plugin records after one round on fixture host `host` (read through `XpuSource`)."""
    source = make_source(host) if base is None else make_source(host, base)
    devices = source.list_devices()
    return NodeSnapshot(
        written_at=NOW,
        interval_seconds=interval_seconds,
        devices=devices,
        device_nodes_present=frozenset(d.index for d in devices if source.device_node_present(d.index)),
        table=source.telemetry(),
        tool_error=None,
        kml_version=source.kml_version(),
        kml_error=None,
        health={
            d.index: CardHealth(HealthState.HEALTHY, ())
            if d.index != 2
            else CardHealth(
                HealthState.HEALTHY, (Finding(2, Check.TEMPERATURE_HIGH, Severity.WARN, "88C >= 85C"),)
            )
            for d in devices
        },
    )


class Clock:
    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def written(tmp_path: Path, snapshot: NodeSnapshot) -> Path:
    path = tmp_path / "node.json"
    write_snapshot(path, snapshot)
    return path


def test_dump_and_parse_round_trip_every_field() -> None:
    snapshot = make_snapshot("p800-failing")
    assert parse_snapshot(dump_snapshot(snapshot), "x") == snapshot
    failed = replace(
        snapshot, table=None, tool_error="xpu-smi: exit status 9", kml_version=None, kml_error="bad"
    )
    assert parse_snapshot(dump_snapshot(failed), "x") == failed


def test_write_is_atomic_and_readable_by_anyone(tmp_path: Path) -> None:
    path = written(tmp_path, make_snapshot())
    assert [p.name for p in tmp_path.iterdir()] == ["node.json"]  # no staged file left behind
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_source_answers_what_xpu_smi_answers(tmp_path: Path) -> None:
    source = SnapshotSource(written(tmp_path, make_snapshot()), clock=Clock(NOW + 5))
    direct = make_source("p800-8")
    assert source.list_devices() == direct.list_devices()
    assert source.telemetry() == direct.telemetry()
    assert source.versions() == direct.versions() == Versions("5.0.21.26", "5.0.21", "1.0.2.14.1.54", "3.2.0")
    assert source.kml_version() == "3.2.0"
    assert [source.device_node_present(i) for i in range(9)] == [True] * 8 + [False]
    assert source.age_seconds() == 5


def test_missing_device_node_is_recorded(tmp_path: Path) -> None:
    source = SnapshotSource(written(tmp_path, make_snapshot("p800-failing")), clock=Clock())
    source.telemetry()
    assert [source.device_node_present(i) for i in range(8)] == [True] * 6 + [False, True]


@pytest.mark.parametrize(
    ("interval", "max_age", "fresh_at", "stale_at"),
    [
        (10.0, None, 90.0, 90.5),  # 3 intervals would be 30 s: the floor of 90 s
        (60.0, None, 180.0, 181.0),  # 3 intervals
        (10.0, 5.0, 5.0, 5.5),  # explicit bound
    ],
)
def test_a_snapshot_older_than_the_bound_is_stale(
    tmp_path: Path, interval: float, max_age: float | None, fresh_at: float, stale_at: float
) -> None:
    clock = Clock()
    source = SnapshotSource(written(tmp_path, make_snapshot(interval_seconds=interval)), max_age, clock)
    clock.now = NOW + fresh_at
    assert len(source.list_devices()) == 8
    clock.now = NOW + stale_at
    with pytest.raises(SnapshotStaleError, match=r"stale: written \d+s ago, more than") as caught:
        source.telemetry()
    assert caught.value.path == str(tmp_path / "node.json")
    # nothing of the stale snapshot is answered, and the device-node check is suspended
    with pytest.raises(SnapshotStaleError):
        source.versions()
    assert source.device_node_present(6) is True
    assert source.age_seconds() == stale_at  # the age is still known


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    source = SnapshotSource(tmp_path / "node.json")
    with pytest.raises(
        SnapshotMissingError, match=r"node snapshot .*node.json: missing \(is the device plugin"
    ):
        source.list_devices()
    assert source.age_seconds() is None
    assert source.device_node_present(0) is True


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda d: "{not json", "unreadable (Expecting property name"),
        (lambda d: "[]", "unreadable (not a JSON object)"),
        (lambda d: json.dumps(d | {"format": 2}), "unreadable (format 2, expected 1)"),
        (
            lambda d: json.dumps({k: v for k, v in d.items() if k != "table"}),
            "unreadable (missing field 'table')",
        ),
        (lambda d: json.dumps(d | {"written_at": "yesterday"}), "written_at is 'yesterday', expected float"),
        (lambda d: json.dumps(d | {"devices": [{"index": 0}]}), "XpuDevice fields ['index'], expected"),
        (
            lambda d: json.dumps(d | {"devices": [d["devices"][0] | {"index": True}]}),
            "index is True, expected int",
        ),
        (
            lambda d: json.dumps(d | {"health": [{"index": 0, "state": "Sick", "findings": []}]}),
            "'Sick' is not",
        ),
        (lambda d: json.dumps(d | {"table": {"cards": 3}}), "table.cards is not a list"),
    ],
)
def test_corrupt_file_is_a_clear_error_never_a_crash(
    tmp_path: Path, mutate: Callable[[dict[str, Any]], str], reason: str
) -> None:
    path = tmp_path / "node.json"
    path.write_text(mutate(json.loads(dump_snapshot(make_snapshot()))))
    with pytest.raises(SnapshotCorruptError) as caught:
        SnapshotSource(path, clock=Clock()).list_devices()
    assert caught.value.reason.startswith("unreadable (") and reason in str(caught.value)


def test_the_plugins_failures_are_replayed(tmp_path: Path) -> None:
    failed = replace(make_snapshot(), table=None, tool_error="xpu-smi: exit status 9: driver gone")
    source = SnapshotSource(written(tmp_path, failed), clock=Clock())
    assert len(source.list_devices()) == 8  # the cards the plugin advertises
    with pytest.raises(
        XpuError, match="the device plugin's xpu-smi failed: xpu-smi: exit status 9: driver gone"
    ):
        source.telemetry()
    with pytest.raises(XpuError, match="xpu-smi failed"):
        source.versions()
    host = copy_host("p800-8", tmp_path)
    (host / "root/usr/local/xpu/kml/VERSION").write_text("version: ???\n")
    with pytest.raises(XpuParseError) as direct:
        make_source("p800-8", tmp_path).kml_version()
    bad_kml = replace(make_snapshot(), kml_version=None, kml_error=str(direct.value))
    source = SnapshotSource(written(tmp_path, bad_kml), clock=Clock())
    with pytest.raises(XpuError, match=r"could not read the KML version: .*not a version string"):
        source.versions()

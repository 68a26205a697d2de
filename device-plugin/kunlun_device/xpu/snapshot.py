"""The node snapshot: what the device plugin read of the hardware in one round, as one JSON file.

The plugin is the only container that touches the device nodes. Each round it writes what its
`XpuSource` answered (cards, the `xpu-smi` table or its failure, device-node presence, the KML
version or its error) plus what it judged (each card's published state and findings) and when, and
the labeler and the exporter read that file instead of running `xpu-smi` (`SnapshotSource`).

Format (`FORMAT` 1): a JSON object with `format`, `written_at` (Unix seconds), `interval_seconds`
(the writer's poll period), `devices`, `device_nodes_present` (card indices), `table` (or null),
`tool_error`, `kml_version`, `kml_error`, `health` (per card: `index`, `state`, `findings`).

Invariant: a file is replaced atomically (write aside, then rename), so a reader sees a whole
snapshot or the previous one; `parse_snapshot` accepts exactly what `dump_snapshot` writes and
raises `SnapshotCorruptError` for anything else, never another exception.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from kunlun_device.errors import SnapshotCorruptError
from kunlun_device.xpu.health import Check, Finding, Severity
from kunlun_device.xpu.health_tracker import HealthState
from kunlun_device.xpu.model import CardTelemetry, SmiTable, XpuDevice

FORMAT = 1
_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (int, float),
    "str": (str,),
    "None": (type(None),),
}


@dataclass(frozen=True, slots=True)
class CardHealth:
    """One card's health as the plugin last published it to kubelet."""

    state: HealthState
    findings: tuple[Finding, ...]


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    """One round of the plugin's view of the node."""

    written_at: float  # Unix seconds (time.time) when the round ended
    interval_seconds: float  # the writer's poll period: the reader's freshness bound derives from it
    devices: tuple[XpuDevice, ...]  # discovered at the plugin's start (what kubelet knows)
    device_nodes_present: frozenset[int]  # indices whose /dev/xpuN existed this round
    table: SmiTable | None  # None when xpu-smi failed this round
    tool_error: str | None  # why, when table is None
    kml_version: str | None
    kml_error: str | None  # the KML version file was unreadable (kml_version is then None)
    health: dict[int, CardHealth]


def dump_snapshot(snapshot: NodeSnapshot) -> str:
    """The JSON text of `snapshot`."""
    data = {
        "format": FORMAT,
        "written_at": snapshot.written_at,
        "interval_seconds": snapshot.interval_seconds,
        "devices": [asdict(d) for d in snapshot.devices],
        "device_nodes_present": sorted(snapshot.device_nodes_present),
        "table": asdict(snapshot.table) if snapshot.table is not None else None,
        "tool_error": snapshot.tool_error,
        "kml_version": snapshot.kml_version,
        "kml_error": snapshot.kml_error,
        "health": [
            {
                "index": index,
                "state": str(card.state),
                "findings": [
                    {"check": str(f.check), "severity": str(f.severity), "detail": f.detail}
                    for f in card.findings
                ],
            }
            for index, card in sorted(snapshot.health.items())
        ],
    }
    return json.dumps(data, indent=1)


def write_snapshot(path: Path, snapshot: NodeSnapshot) -> None:
    """Atomically replace `path` with `snapshot`, readable by any user (the readers run unprivileged).

    Raises:
        OSError: the directory is missing or not writable.
    """
    staged = path.with_name(f".{path.name}.new")
    staged.write_text(dump_snapshot(snapshot))
    staged.chmod(0o644)
    os.replace(staged, path)


def parse_snapshot(text: str, source: str) -> NodeSnapshot:
    """The snapshot in `text` (the contents of file `source`).

    Raises:
        SnapshotCorruptError: not JSON, another format version, or a field missing or mistyped.
    """
    try:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
        table = data["table"]
        return NodeSnapshot(
            written_at=_check(data["written_at"], "float", "written_at"),
            interval_seconds=_check(data["interval_seconds"], "float", "interval_seconds"),
            devices=tuple(_record(XpuDevice, item) for item in _list(data["devices"], "devices")),
            device_nodes_present=frozenset(
                _check(i, "int", "device_nodes_present") for i in _list(data["device_nodes_present"], "nodes")
            ),
            table=None if table is None else _table(table),
            tool_error=_check(data["tool_error"], "str | None", "tool_error"),
            kml_version=_check(data["kml_version"], "str | None", "kml_version"),
            kml_error=_check(data["kml_error"], "str | None", "kml_error"),
            health=dict(_health(item) for item in _list(data["health"], "health")),
        )
    except (KeyError, TypeError, ValueError, RecursionError) as exc:
        detail = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
        raise SnapshotCorruptError(source, f"unreadable ({detail})") from exc


def _check(value: Any, annotation: str, name: str) -> Any:
    allowed = tuple(t for part in annotation.split(" | ") for t in _TYPES[part])
    if isinstance(value, bool) or not isinstance(value, allowed):
        raise TypeError(f"{name} is {value!r}, expected {annotation}")
    return value


def _list(value: Any, name: str) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError(f"{name} is not a list")
    return value


def _record(cls: type[Any], item: Any, **nested: Any) -> Any:
    """An instance of dataclass `cls` from a JSON object holding exactly its fields (type-checked)."""
    if not isinstance(item, dict):
        raise TypeError(f"{cls.__name__} is not an object")
    names = [f.name for f in fields(cls)]
    if set(item) != set(names):
        raise ValueError(f"{cls.__name__} fields {sorted(item)}, expected {sorted(names)}")
    values = {
        f.name: nested[f.name] if f.name in nested else _check(item[f.name], str(f.type), f.name)
        for f in fields(cls)
    }
    return cls(**values)


def _table(item: Any) -> SmiTable:
    if not isinstance(item, dict):
        raise TypeError("table is not an object")
    cards = tuple(_record(CardTelemetry, card) for card in _list(item.get("cards"), "table.cards"))
    return _record(SmiTable, item, cards=cards)  # type: ignore[no-any-return]


def _health(item: Any) -> tuple[int, CardHealth]:
    if not isinstance(item, dict):
        raise TypeError("health entry is not an object")
    index = _check(item["index"], "int", "health.index")
    findings = tuple(
        Finding(index, Check(f["check"]), Severity(f["severity"]), _check(f["detail"], "str", "detail"))
        for f in _list(item["findings"], "health.findings")
    )
    return index, CardHealth(HealthState(item["state"]), findings)

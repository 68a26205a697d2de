"""The plugin's fault-response state as one JSON file: what it holds quarantined, its failure counts,
whether it has read its Node since it started, and its failed API calls.

The plugin writes the same document to two places, each only when its text changed:
- `--state-file` (node-local, a hostPath in the chart): read back at the next start, so that until
  the Node is read again the cards quarantined last time stay Unhealthy (fail closed for those cards
  only) and failures recorded while the API was unreachable are not lost. It holds the document
  without its counters (`persisted`: `api_errors` empty, `pods_unwritten` 0): they count since the
  plugin started, and with them a call failing every round would rewrite the host file every round;
- `--quarantine-file` (a shared in-memory volume): the exporter's source of `kunlun_xpu_quarantined`
  and the fault-response metrics (`kunlun_device.exporter.metrics`).

Format (`FORMAT` 1): a JSON object with exactly `format`, `node_read`, `quarantined`,
`unwritten_quarantine` (card UUIDs), `failures`, `unwritten_failures` (UUID -> Unix seconds, as in
`kunlun_device.faults.history`), `api_errors` (call -> failed calls since the plugin started) and
`pods_unwritten` (pods whose condition is not written yet). "Unwritten" parts are what the plugin
decided but could not yet write to the Node: they are written as soon as the API answers.

Invariant: files are replaced atomically (write aside, rename); `parse_state` accepts exactly what
`dump_state` writes and raises `FaultStateError` for anything else, never another exception.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kunlun_device.errors import FaultStateError
from kunlun_device.faults.history import parse_history
from kunlun_device.faults.quarantine import UUID_PATTERN, History

logger = logging.getLogger(__name__)
FORMAT = 1
FIELDS = frozenset(
    {
        "format",
        "node_read",
        "quarantined",
        "unwritten_quarantine",
        "failures",
        "unwritten_failures",
        "api_errors",
        "pods_unwritten",
    }
)


@dataclass(frozen=True, slots=True)
class FaultState:
    """One moment of the fault response, as persisted and as the exporter reports it."""

    quarantined: frozenset[str] = frozenset()  # cards held Unhealthy as quarantined
    unwritten_quarantine: frozenset[str] = frozenset()  # quarantined by the plugin, not yet on the Node
    failures: History = field(default_factory=dict)  # recent failures within the window, written or not
    unwritten_failures: History = field(default_factory=dict)  # those not yet on the Node
    node_read: bool = False  # the Node was read since the plugin started: its annotation is the authority
    api_errors: Mapping[str, int] = field(default_factory=dict)  # call -> failed calls since start
    pods_unwritten: int = 0  # pods whose condition could not be written (retried every round)


def dump_state(state: FaultState) -> str:
    """The JSON text of `state` (sorted, so equal states give equal texts)."""
    data = {
        "format": FORMAT,
        "node_read": state.node_read,
        "quarantined": sorted(state.quarantined),
        "unwritten_quarantine": sorted(state.unwritten_quarantine),
        "failures": {u: list(t) for u, t in sorted(state.failures.items())},
        "unwritten_failures": {u: list(t) for u, t in sorted(state.unwritten_failures.items())},
        "api_errors": dict(sorted(state.api_errors.items())),
        "pods_unwritten": state.pods_unwritten,
    }
    return json.dumps(data, sort_keys=True)


def parse_state(text: str, source: str) -> FaultState:
    """The state in `text` (the contents of file `source`).

    Raises:
        FaultStateError: not JSON, another format, or a field missing or of the wrong shape (named).
    """
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise FaultStateError(source, f"not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise FaultStateError(source, "not a JSON object")
    if data.get("format") != FORMAT:
        raise FaultStateError(source, f"format is {data.get('format')!r}, expected {FORMAT}")
    if set(data) != FIELDS:
        raise FaultStateError(source, f"fields {sorted(data)}, expected {sorted(FIELDS)}")
    if not isinstance(data["node_read"], bool):
        raise FaultStateError(source, "node_read is not true or false")
    return FaultState(
        quarantined=_uuids(data["quarantined"], source, "quarantined"),
        unwritten_quarantine=_uuids(data["unwritten_quarantine"], source, "unwritten_quarantine"),
        failures=parse_history(data["failures"], source, "failures"),
        unwritten_failures=parse_history(data["unwritten_failures"], source, "unwritten_failures"),
        node_read=data["node_read"],
        api_errors=_counts(data["api_errors"], source),
        pods_unwritten=_count(data["pods_unwritten"], source, "pods_unwritten"),
    )


def write_state_file(path: Path, text: str) -> None:
    """Atomically replace `path` with `text` (a `dump_state`), readable by any user.

    Raises:
        OSError: the directory is missing or not writable.
    """
    staged = path.with_name(f".{path.name}.new")
    staged.write_text(text)
    staged.chmod(0o644)
    os.replace(staged, path)


def read_state_file(path: Path) -> FaultState:
    """The state in a file written by `write_state_file`.

    Raises:
        FaultStateError: the file is missing, unreadable or not a state document.
    """
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise FaultStateError(str(path), "missing") from None
    except OSError as exc:
        raise FaultStateError(str(path), f"unreadable ({exc})") from None
    return parse_state(text, str(path))


def persisted(state: FaultState) -> FaultState:
    """What `--state-file` holds of `state`: all but the counters of this run (`api_errors`,
    `pods_unwritten`), which change every round while a call keeps failing."""
    return replace(state, api_errors={}, pods_unwritten=0)


class StateFiles:
    """Writes a state to the node-local state file (`persisted`) and to the exporter's file (whole),
    each only when its text differs from the one last written there; a failed write is logged and
    retried at the next `write`, never raised."""

    def __init__(self, state_file: Path | None, exporter_file: Path | None) -> None:
        files = ((state_file, persisted), (exporter_file, _whole))
        self._views: dict[Path, Callable[[FaultState], FaultState]] = {
            path: view for path, view in files if path is not None
        }  # path -> what of a state it holds
        self._written = dict.fromkeys(self._views, "")  # path -> text written

    def write(self, state: FaultState) -> None:
        for path, view in self._views.items():
            text = dump_state(view(state))
            if self._written[path] == text:
                continue
            try:
                write_state_file(path, text)
            except OSError as exc:
                logger.warning("fault state file %s not written (retrying next round): %s", path, exc)
                continue
            self._written[path] = text


def _whole(state: FaultState) -> FaultState:
    return state


def read_fault_state(path: Path) -> FaultState | None:
    """The state in `path`, or None when there is none yet (missing) or it is unusable (logged)."""
    try:
        return read_state_file(path)
    except FaultStateError as exc:
        if exc.reason != "missing":
            logger.warning("%s", exc)
        return None


def read_quarantine_file(path: Path) -> frozenset[str]:
    """The quarantined UUIDs in a state file; empty when there is none or it is unusable (logged)."""
    state = read_fault_state(path)
    return state.quarantined if state is not None else frozenset()


def _uuids(value: Any, source: str, name: str) -> frozenset[str]:
    if not isinstance(value, list) or not all(
        isinstance(u, str) and UUID_PATTERN.fullmatch(u) for u in value
    ):
        raise FaultStateError(source, f"{name} is not a list of card UUIDs")
    return frozenset(value)


def _count(value: Any, source: str, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise FaultStateError(source, f"{name} is {value!r}, expected a count")
    return value


def _counts(value: Any, source: str) -> dict[str, int]:
    if not isinstance(value, dict):
        raise FaultStateError(source, "api_errors is not an object")
    return {str(call): _count(n, source, f"api_errors.{call}") for call, n in value.items()}

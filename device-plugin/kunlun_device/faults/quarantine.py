"""Quarantine bookkeeping: count each card's failures in a sliding window; the Node annotation format.

A card that turns Unhealthy `max_failures` times within `window_seconds` is quarantined: it stays
Unhealthy (not allocatable, pod condition False) until an operator removes it from the Node
annotation `kunlun.dev/xpu-quarantine` (comma-separated card UUIDs). The annotation is the only
persistent state; the failure window lives in memory (an agent restart starts counting afresh).

Invariant: pure — times come from the caller's monotonic clock; nothing here does I/O except the
two small file helpers at the end (the exporter's view of the quarantine, written by the plugin).
"""

from __future__ import annotations

import json
import logging
import os
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from kunlun_device.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class QuarantinePolicy:
    """When a flapping card is quarantined."""

    max_failures: int = 3  # Healthy -> Unhealthy transitions within the window that quarantine a card
    window_seconds: float = 600.0

    def __post_init__(self) -> None:
        if self.max_failures < 1:
            raise ConfigError("--quarantine-failures", "must be >= 1")
        if self.window_seconds <= 0:
            raise ConfigError("--quarantine-window-seconds", "must be > 0")


class FailureWindow:
    """Per-card times of recent failures; says when a card has failed too often."""

    def __init__(self, policy: QuarantinePolicy) -> None:
        self.policy = policy
        self._failures: dict[str, deque[float]] = {}

    def record(self, uuid: str, now: float) -> bool:
        """Count one failure of card `uuid` at `now`; True when it reaches the quarantine threshold."""
        times = self._failures.setdefault(uuid, deque())
        times.append(now)
        while times and now - times[0] > self.policy.window_seconds:
            times.popleft()
        return len(times) >= self.policy.max_failures

    def count(self, uuid: str) -> int:
        """Failures of `uuid` still remembered (those older than the window go at the next record)."""
        return len(self._failures.get(uuid, ()))

    def forget(self, uuid: str) -> None:
        """Start counting afresh (the card was re-admitted)."""
        self._failures.pop(uuid, None)


def parse_quarantine(value: str | None) -> frozenset[str]:
    """The card UUIDs in an annotation value (`None`: no annotation); blanks and spaces are ignored."""
    return frozenset(part.strip() for part in (value or "").split(",") if part.strip())


def format_quarantine(uuids: frozenset[str]) -> str | None:
    """The annotation value for `uuids`, sorted; None (remove the annotation) when empty."""
    return ",".join(sorted(uuids)) or None


def write_quarantine_file(path: Path, uuids: frozenset[str]) -> None:
    """Atomically replace `path` with the JSON list of quarantined UUIDs (read by the exporter)."""
    staged = path.with_name(f".{path.name}.new")
    staged.write_text(json.dumps(sorted(uuids)))
    os.replace(staged, path)


def read_quarantine_file(path: Path) -> frozenset[str]:
    """The UUIDs in a file written by `write_quarantine_file`; empty (and logged) when unreadable."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return frozenset()
    except (OSError, ValueError) as exc:
        logger.warning("quarantine file %s unreadable: %s", path, exc)
        return frozenset()
    if not isinstance(data, list) or not all(isinstance(item, str) for item in data):
        logger.warning("quarantine file %s: expected a JSON list of strings", path)
        return frozenset()
    return frozenset(data)

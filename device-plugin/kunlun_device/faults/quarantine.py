"""Quarantine bookkeeping: count each card's failures in a sliding window; the Node annotation format.

A card that turns Unhealthy `max_failures` times within `window_seconds` is quarantined: it stays
Unhealthy (not allocatable, pod condition False) until an operator removes it from the Node
annotation `kunlun.dev/xpu-quarantine` (comma-separated card UUIDs). The failure times are Unix
seconds (the node's wall clock), so they can be persisted (`kunlun_device.faults.history`) and a
restarted agent goes on counting where it stopped.

Invariant: pure — times come from the caller; nothing here does I/O or logs.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kunlun_device.errors import ConfigError

#: What a card UUID may look like (`GPU-7c1f…`): an annotation entry outside it names no card.
UUID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")

History = dict[str, tuple[float, ...]]  # card UUID -> failure times (Unix seconds), oldest first


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


def prune_history(history: Mapping[str, Iterable[float]], now: float, policy: QuarantinePolicy) -> History:
    """`history` without failures older than the window (before `now`) and without empty cards;
    each card keeps at most its last `max_failures` times, sorted (a time counted twice is one)."""
    pruned: History = {}
    for uuid, times in history.items():
        recent = sorted({t for t in times if now - t <= policy.window_seconds})
        if recent:
            pruned[uuid] = tuple(recent[-policy.max_failures :])
    return pruned


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

    def history(self, now: float) -> History:
        """The failures still inside the window at `now` (see `prune_history`)."""
        return prune_history(self._failures, now, self.policy)

    def replace(self, history: Mapping[str, Iterable[float]], now: float) -> None:
        """Count from `history` from now on (read back after a restart, or from the Node)."""
        self._failures = {u: deque(t) for u, t in prune_history(history, now, self.policy).items()}


def parse_quarantine(value: str | None) -> frozenset[str]:
    """The card UUIDs in an annotation value (`None`: no annotation); blanks and spaces are ignored."""
    return frozenset(part.strip() for part in (value or "").split(",") if part.strip())


def invalid_quarantine_entries(value: str | None) -> list[str]:
    """The entries of an annotation value that cannot be card UUIDs (e.g. `GPU-1 GPU-2`, space-separated)."""
    return sorted(u for u in parse_quarantine(value) if not UUID_PATTERN.fullmatch(u))


def format_quarantine(uuids: frozenset[str]) -> str | None:
    """The annotation value for `uuids`, sorted; None (remove the annotation) when empty."""
    return ",".join(sorted(uuids)) or None

"""Quarantine bookkeeping: count each card's failures in a sliding window; the Node annotation format.

A card that turns Unhealthy `max_failures` times within `window_seconds` is quarantined: it stays
Unhealthy (not allocatable, pod condition False) until an operator removes it from the Node
annotation `kunlun.dev/xpu-quarantine` (comma-separated card UUIDs). The failure times are Unix
seconds (the node's wall clock), so they can be persisted (`kunlun_device.faults.history`) and a
restarted agent goes on counting where it stopped. A time later than now by more than
`FUTURE_SLACK_SECONDS` (a clock stepped back, a hand-edited annotation) is not a failure that
happened: it is dropped, or it would wait outside the window and count once the clock reached it.

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
#: How far ahead of now a failure time may be and still count (clocks of one node drift a little).
FUTURE_SLACK_SECONDS = 60.0


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


def is_future(t: float, now: float) -> bool:
    """`t` is later than `now` by more than `FUTURE_SLACK_SECONDS`: not a failure that happened."""
    return t - now > FUTURE_SLACK_SECONDS


def future_failures(history: Mapping[str, Iterable[float]], now: float) -> History:
    """The times in `history` that are in the future (`is_future`), per card, sorted."""
    future = {uuid: tuple(sorted({t for t in times if is_future(t, now)})) for uuid, times in history.items()}
    return {uuid: times for uuid, times in future.items() if times}


def prune_history(history: Mapping[str, Iterable[float]], now: float, policy: QuarantinePolicy) -> History:
    """`history` without failures older than the window (before `now`), without future ones
    (`is_future`) and without empty cards; each card keeps at most its last `max_failures` times,
    sorted (a time counted twice is one)."""
    pruned: History = {}
    for uuid, times in history.items():
        recent = sorted({t for t in times if now - t <= policy.window_seconds and not is_future(t, now)})
        if recent:
            pruned[uuid] = tuple(recent[-policy.max_failures :])
    return pruned


class FailureWindow:
    """Per-card times of recent failures; says when a card has failed too often."""

    def __init__(self, policy: QuarantinePolicy) -> None:
        self.policy = policy
        self._failures: dict[str, deque[float]] = {}

    def record(self, uuid: str, now: float) -> bool:
        """Count one failure of card `uuid` at `now`; True when it reaches the quarantine threshold.
        Times now in the future (the clock stepped back since they were counted) are dropped."""
        times = self._failures.setdefault(uuid, deque())
        if any(is_future(t, now) for t in times):
            self._failures[uuid] = times = deque(t for t in times if not is_future(t, now))
        times.append(now)
        while times and now - times[0] > self.policy.window_seconds:
            times.popleft()
        return len(times) >= self.policy.max_failures

    def count(self, uuid: str) -> int:
        """Failures of `uuid` still remembered (those older than the window go at the next record)."""
        return len(self._failures.get(uuid, ()))

    def future(self, now: float) -> History:
        """The times counted that are in the future at `now` (`future_failures`); `record` and
        `replace` drop them."""
        return future_failures(self._failures, now)

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

"""Per-card health state with recovery: Unhealthy at once, Healthy again after a clear period.

A card becomes Unhealthy as soon as one of its findings has severity `unhealthy`. It becomes
Healthy again only when no such finding has been seen for `recovery_seconds` (measured on an
injected monotonic clock, so tests need no sleeping). Every transition is logged and counted.

Invariant: `state()` of a card changes only through `update()`, and every change is both logged and
counted in `transitions_total` exactly once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from kunlun_device.xpu.health import Finding, Severity
from kunlun_device.xpu.model import XpuDevice

logger = logging.getLogger(__name__)


class HealthState(StrEnum):
    """The two values kubelet understands (the device plugin API's `Healthy`/`Unhealthy`)."""

    HEALTHY = "Healthy"
    UNHEALTHY = "Unhealthy"


@dataclass(frozen=True, slots=True)
class Transition:
    """One change of a card's state."""

    index: int
    uuid: str
    before: HealthState
    after: HealthState
    reason: str


class HealthTracker:
    """Tracks the health state of a fixed set of cards. Thread-safe."""

    def __init__(
        self,
        devices: tuple[XpuDevice, ...],
        recovery_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._devices = {device.index: device for device in devices}
        self._recovery_seconds = recovery_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._states = dict.fromkeys(self._devices, HealthState.HEALTHY)
        self._clear_since: dict[int, float | None] = dict.fromkeys(self._devices)
        self._findings: dict[int, tuple[Finding, ...]] = {index: () for index in self._devices}
        self.transitions_total: Counter[tuple[int, HealthState]] = Counter()

    def state(self, index: int) -> HealthState:
        with self._lock:
            return self._states[index]

    def states(self) -> dict[int, HealthState]:
        with self._lock:
            return dict(self._states)

    def findings(self) -> dict[int, tuple[Finding, ...]]:
        """The findings of the last update, per card (warn ones included)."""
        with self._lock:
            return dict(self._findings)

    def update(self, findings: dict[int, tuple[Finding, ...]]) -> list[Transition]:
        """Apply one round of check results; returns the transitions it caused.

        Cards missing from `findings` are treated as having no findings.
        """
        now = self._clock()
        transitions: list[Transition] = []
        with self._lock:
            for index, device in self._devices.items():
                current = findings.get(index, ())
                self._findings[index] = current
                for finding in current:
                    if finding.severity is Severity.WARN:
                        logger.warning("xpu%d %s: %s (warn only)", index, finding.check, finding.detail)
                faults = [f for f in current if f.severity is Severity.UNHEALTHY]
                transition = self._step(device, faults, now)
                if transition is not None:
                    transitions.append(transition)
                    self.transitions_total[(index, transition.after)] += 1
        for t in transitions:
            log = logger.warning if t.after is HealthState.UNHEALTHY else logger.info
            log("xpu%d (%s) %s -> %s: %s", t.index, t.uuid, t.before, t.after, t.reason)
        return transitions

    def _step(self, device: XpuDevice, faults: list[Finding], now: float) -> Transition | None:
        index, before = device.index, self._states[device.index]
        if faults:
            self._clear_since[index] = None
            if before is HealthState.UNHEALTHY:
                return None
            self._states[index] = HealthState.UNHEALTHY
            reason = "; ".join(f"{f.check}: {f.detail}" for f in faults)
            return Transition(index, device.uuid, before, HealthState.UNHEALTHY, reason)
        if before is HealthState.HEALTHY:
            return None
        since = self._clear_since[index]
        if since is None:
            self._clear_since[index] = since = now
        if now - since < self._recovery_seconds:
            return None
        self._states[index] = HealthState.HEALTHY
        self._clear_since[index] = None
        reason = f"no fault for {now - since:g}s (recovery period {self._recovery_seconds:g}s)"
        return Transition(index, device.uuid, before, HealthState.HEALTHY, reason)

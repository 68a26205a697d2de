"""`HealthMonitor`: one polling round = read telemetry, run the checks, update the tracker.

Shared by the device plugin (which streams states to kubelet) and the exporter (which publishes
readings, findings and states). Owns no thread: callers decide when to poll.

Invariant: `poll()` never raises an `XpuError`; a failed tool call becomes `tool-error` findings and
a snapshot without readings.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from kunlun_device.errors import XpuError
from kunlun_device.xpu.health import Finding, HealthPolicy, evaluate
from kunlun_device.xpu.health_tracker import HealthState, HealthTracker, Transition
from kunlun_device.xpu.model import SmiTable, XpuDevice
from kunlun_device.xpu.reader import XpuReader

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HealthSnapshot:
    """The result of one polling round."""

    table: SmiTable | None  # None when xpu-smi failed this round
    tool_error: str | None
    findings: dict[int, tuple[Finding, ...]]
    states: dict[int, HealthState]
    transitions: tuple[Transition, ...]


class HealthMonitor:
    """Polls one `XpuReader` (`XpuSource` or `SnapshotSource`) for a fixed set of cards."""

    def __init__(
        self,
        source: XpuReader,
        devices: tuple[XpuDevice, ...],
        policy: HealthPolicy,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.source = source
        self.devices = devices
        self.policy = policy
        kwargs = {} if clock is None else {"clock": clock}
        self.tracker = HealthTracker(devices, policy.recovery_seconds, **kwargs)
        self.tool_errors_total = 0

    def poll(self) -> HealthSnapshot:
        """Run one round of checks and return what it saw."""
        table: SmiTable | None = None
        tool_error: str | None = None
        try:
            table = self.source.telemetry()
        except XpuError as exc:
            tool_error = str(exc)
            self.tool_errors_total += 1
            logger.warning("health check: %s", exc)
        findings = evaluate(self.devices, table, tool_error, self.source.device_node_present, self.policy)
        transitions = self.tracker.update(findings)
        return HealthSnapshot(table, tool_error, findings, self.tracker.states(), tuple(transitions))

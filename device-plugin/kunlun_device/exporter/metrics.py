"""Prometheus metric families for the cards of one node, built from the exporter's last state.

Per-card metrics carry `device` (xpu<index>), `uuid`, `node` and the holder's `namespace`, `pod`,
`container` (empty strings when no pod holds the card). See docs/device-plugin.md for the list.

Invariant: a reading that is not available (N/A, or xpu-smi failed this round) is left out, never
exported as 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kunlun_device.faults.api_errors import CALLS
from kunlun_device.faults.state import FaultState
from kunlun_device.podresources import Holder
from kunlun_device.xpu.health_tracker import HealthState
from kunlun_device.xpu.model import CardTelemetry, Versions, XpuDevice
from kunlun_device.xpu.monitor import HealthSnapshot

CARD_LABELS = ["device", "uuid", "node", "namespace", "pod", "container"]
ID_LABELS = ["device", "uuid", "node"]
INFO_LABELS = [*ID_LABELS, "product", "driver_version", "runtime_version", "firmware_version", "kml_version"]
NO_HOLDER = Holder("", "", "")


@dataclass(frozen=True, slots=True)
class ExporterState:
    """Everything one scrape reports."""

    node: str
    devices: tuple[XpuDevice, ...]
    versions: Versions
    snapshot: HealthSnapshot
    holders: dict[str, Holder]
    transitions_total: dict[tuple[int, HealthState], int]
    tool_errors_total: int
    fault: FaultState | None = None  # the plugin's fault-response state (its quarantine file), if any

    @property
    def quarantined(self) -> frozenset[str]:
        """UUIDs the plugin holds quarantined (none without its file)."""
        return self.fault.quarantined if self.fault is not None else frozenset()


_READINGS: tuple[tuple[str, str, Callable[[CardTelemetry], float | None]], ...] = (
    ("kunlun_xpu_utilization_ratio", "XPU utilisation (0-1)", lambda c: c.utilization_ratio),
    ("kunlun_xpu_memory_used_bytes", "Device memory in use", lambda c: c.memory_used_bytes),
    ("kunlun_xpu_memory_total_bytes", "Device memory size", lambda c: c.memory_total_bytes),
    ("kunlun_xpu_temperature_celsius", "Chip temperature", lambda c: c.temperature_celsius),
    ("kunlun_xpu_power_watts", "Power draw", lambda c: c.power_watts),
)


def build_metrics(state: ExporterState, snapshot_age_seconds: float | None = None) -> list[Metric]:
    """All metric families of one scrape; `snapshot_age_seconds` only when reading a node snapshot."""
    ids = {d.index: [f"xpu{d.index}", d.uuid, state.node] for d in state.devices}
    labels = {}
    for d in state.devices:
        holder = state.holders.get(d.uuid, NO_HOLDER)
        labels[d.index] = [*ids[d.index], holder.namespace, holder.pod, holder.container]
    readings = {c.index: c for c in state.snapshot.table.cards} if state.snapshot.table else {}
    families: list[Metric] = []
    for name, documentation, read in _READINGS:
        family = GaugeMetricFamily(name, documentation, labels=CARD_LABELS)
        for index, card in sorted(readings.items()):
            value = read(card)
            if index in labels and value is not None:
                family.add_metric(labels[index], value)
        families.append(family)
    ecc = CounterMetricFamily(
        "kunlun_xpu_ecc_errors", "Volatile uncorrectable ECC errors (reset with the card)", labels=CARD_LABELS
    )
    for index, card in sorted(readings.items()):
        if index in labels and card.ecc_uncorrectable_errors is not None:
            ecc.add_metric(labels[index], card.ecc_uncorrectable_errors)
    healthy = GaugeMetricFamily(
        "kunlun_xpu_healthy", "1 when the card is Healthy, 0 when Unhealthy", labels=CARD_LABELS
    )
    for index, health in sorted(state.snapshot.states.items()):
        healthy.add_metric(labels[index], 1.0 if health is HealthState.HEALTHY else 0.0)
    quarantined = GaugeMetricFamily(
        "kunlun_xpu_quarantined",
        "1 while the card is quarantined (failed too often; an operator must re-admit it)",
        labels=CARD_LABELS,
    )
    for d in sorted(state.devices, key=lambda d: d.index):
        quarantined.add_metric(labels[d.index], 1.0 if d.uuid in state.quarantined else 0.0)
    families += [ecc, healthy, quarantined, *_node_families(state, ids), *_fault_families(state)]
    if snapshot_age_seconds is not None:
        age = GaugeMetricFamily(
            "kunlun_xpu_snapshot_age_seconds",
            "Age of the device plugin's node snapshot the readings come from",
            labels=["node"],
        )
        age.add_metric([state.node], snapshot_age_seconds)
        families.append(age)
    return families


def _node_families(state: ExporterState, ids: dict[int, list[str]]) -> Iterator[Metric]:
    versions = state.versions
    info = GaugeMetricFamily("kunlun_xpu_info", "Card identity and software versions", labels=INFO_LABELS)
    for d in state.devices:
        firmware = d.firmware_version or ""
        info.add_metric(
            [
                *ids[d.index],
                d.product,
                versions.driver or "",
                versions.runtime or "",
                firmware,
                versions.kml or "",
            ],
            1,
        )
    yield info
    transitions = CounterMetricFamily(
        "kunlun_xpu_health_transitions",
        "Health state changes, by the state entered",
        labels=[*ID_LABELS, "state"],
    )
    for (index, after), count in sorted(state.transitions_total.items()):
        transitions.add_metric([*ids[index], str(after)], count)
    yield transitions
    finding = GaugeMetricFamily(
        "kunlun_xpu_health_finding",
        "1 for each failing health check",
        labels=[*ID_LABELS, "check", "severity"],
    )
    for index, found in sorted(state.snapshot.findings.items()):
        for f in found:
            finding.add_metric([*ids[index], str(f.check), str(f.severity)], 1)
    yield finding
    tool = CounterMetricFamily(
        "kunlun_xpu_tool_errors", "Failed xpu-smi calls (or unusable node snapshots)", labels=["node"]
    )
    tool.add_metric([state.node], state.tool_errors_total)
    yield tool


def _fault_families(state: ExporterState) -> Iterator[Metric]:
    """The plugin's fault response, from its quarantine file; nothing without one (never zeros)."""
    fault = state.fault
    if fault is None:
        return
    errors = CounterMetricFamily(
        "kunlun_xpu_fault_api_errors",
        "Failed Kubernetes API calls of the plugin's fault response since it started, by call",
        labels=["node", "call"],
    )
    for call in sorted(set(CALLS) | set(fault.api_errors)):
        errors.add_metric([state.node, call], fault.api_errors.get(call, 0))
    yield errors
    pods = GaugeMetricFamily(
        "kunlun_xpu_fault_pods_unwritten",
        "Pods whose kunlun.dev/xpu-healthy condition the plugin could not write (retried every round)",
        labels=["node"],
    )
    pods.add_metric([state.node], fault.pods_unwritten)
    yield pods
    node_read = GaugeMetricFamily(
        "kunlun_xpu_fault_node_read",
        "1 once the plugin has read its Node since it started; 0 while it holds its last-known quarantine",
        labels=["node"],
    )
    node_read.add_metric([state.node], 1.0 if fault.node_read else 0.0)
    yield node_read


class StateCollector(Collector):
    """A prometheus_client collector reporting whatever state `current()` returns (None: nothing).

    `snapshot_age()`, when given, is asked at each scrape (so the age keeps growing while the
    plugin is silent); it returns None until a snapshot was read.
    """

    def __init__(
        self,
        current: Callable[[], ExporterState | None],
        snapshot_age: Callable[[], float | None] | None = None,
    ) -> None:
        self._current = current
        self._snapshot_age = snapshot_age

    def collect(self) -> Iterator[Metric]:
        state = self._current()
        if state is not None:
            age = self._snapshot_age() if self._snapshot_age is not None else None
            yield from build_metrics(state, age)

"""The operator's own Prometheus metrics (served on ``--metrics-port`` at ``/metrics``).

Owns: metric names and labels (listed in docs/operator.md). A private registry, so tests and
several operators in one process never collide.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from kunlun_operator.decide.status import PHASES

RECONCILE_RESULTS = ("success", "invalid", "retry", "error")
ADMISSION_RESULTS = ("allowed", "warned", "denied")


@dataclass
class OperatorMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        self.reconcile_total = Counter(
            "kunlun_operator_reconcile_total",
            "Reconciles of KunlunInferenceServices by result.",
            ["result"],
            registry=self.registry,
        )
        self.reconcile_duration = Histogram(
            "kunlun_operator_reconcile_duration_seconds",
            "Duration of one reconcile.",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
        self.managed_services = Gauge(
            "kunlun_operator_managed_services",
            "KunlunInferenceServices by phase.",
            ["phase"],
            registry=self.registry,
        )
        self.object_changes = Counter(
            "kunlun_operator_object_changes_total",
            "Writes to owned objects.",
            ["kind", "action"],
            registry=self.registry,
        )
        self.admission_reviews = Counter(
            "kunlun_operator_admission_reviews_total",
            "Admission reviews by result.",
            ["result"],
            registry=self.registry,
        )
        self.replica_replacements = Counter(
            "kunlun_operator_replica_replacements_total",
            "Replicas evicted because their XPU card stayed unhealthy for spec.faultTolerance.replaceAfter,"
            " by the card's fault reason.",
            ["reason"],
            registry=self.registry,
        )
        self.health_gates_opened = Counter(
            "kunlun_operator_health_gates_opened_total",
            "Runtime pods whose kunlun.dev/xpu-healthy readiness gate the operator set True (reason"
            " NoHealthReporter) because no device plugin reported their card health within the grace period.",
            registry=self.registry,
        )
        self.unmonitored_pods = Gauge(
            "kunlun_operator_unmonitored_pods",
            "Runtime pods whose card health no device plugin reports: their readiness gate was set by"
            " the operator (NoHealthReporter) and the device plugin has not written its own verdict since.",
            registry=self.registry,
        )
        for phase in PHASES:
            self.managed_services.labels(phase=phase).set(0)
        # Counters start at 0 for every known label value: rate() and increase() need a sample
        # before the first event, or the first error/denial would never count in an alert.
        for result in RECONCILE_RESULTS:
            self.reconcile_total.labels(result=result)
        for result in ADMISSION_RESULTS:
            self.admission_reviews.labels(result=result)

    def set_phases(self, phases: dict[tuple[str, str], str]) -> None:
        """Publish how many services are in each phase (``phases``: key → phase)."""
        counts: dict[str, int] = dict.fromkeys(PHASES, 0)
        for phase in phases.values():
            counts[phase] = counts.get(phase, 0) + 1
        for phase, count in counts.items():
            self.managed_services.labels(phase=phase).set(count)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        start_http_server(port, addr=addr, registry=self.registry)

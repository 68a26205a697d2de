"""The operator's counters exist at 0 before their first event, so rate()/increase() in the
chart's alerts count the first reconcile error and the first denial."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kunlun_operator.shell.metrics import ADMISSION_RESULTS, RECONCILE_RESULTS, OperatorMetrics


def samples(metrics: OperatorMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_reconcile_and_admission_counters_start_at_zero_for_every_result() -> None:
    exposed = samples(OperatorMetrics())
    for result in RECONCILE_RESULTS:
        assert exposed[("kunlun_operator_reconcile_total", (("result", result),))] == 0
    for result in ADMISSION_RESULTS:
        assert exposed[("kunlun_operator_admission_reviews_total", (("result", result),))] == 0


def test_an_event_counts_from_zero() -> None:
    metrics = OperatorMetrics()
    metrics.reconcile_total.labels(result="error").inc()
    assert samples(metrics)[("kunlun_operator_reconcile_total", (("result", "error"),))] == 1

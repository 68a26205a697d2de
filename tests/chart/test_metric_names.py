"""Every metric the dashboard and the alerts use exists in what the components really export.

Exported names are collected from the real code: the runtime's `EngineMetrics`, the operator's
`OperatorMetrics` and the device-plugin `Exporter` run against the 8-card P800 fixture host, each
built into a fresh `CollectorRegistry`, scraped in the Prometheus text format and parsed (so
histograms contribute their `_bucket`/`_sum`/`_count` series and counters their `_total`).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kunlun_device.exporter import Exporter
from kunlun_device.xpu.health import HealthPolicy
from kunlun_device.xpu.source import XpuSource
from kunlun_operator.shell.metrics import OperatorMetrics
from kunlun_runtime.server.metrics import EngineMetrics
from kunlun_runtime.server.spec_metrics import SpecDecodeMetrics
from tests.chart.promql_names import label_values_metric, metric_names
from tests.chart.tools import REPO, Rendered

# Series Prometheus itself makes for every scrape target; no component exports them.
PROMETHEUS_SYNTHETIC = frozenset({"up"})
# Which component must export a metric, by name prefix.
OWNERS = {"vllm:": "runtime", "kunlun:": "runtime", "kunlun_xpu_": "exporter", "kunlun_operator_": "operator"}


def scraped_names(registry: CollectorRegistry) -> set[str]:
    """Sample names of one scrape of `registry`, plus the series each family type always has."""
    names = set()
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        names |= {sample.name for sample in family.samples}
        suffixes = {
            "counter": ("_total",),
            "histogram": ("_bucket", "_sum", "_count"),
            "gauge": ("",),
            "info": ("_info",),
            "summary": ("_sum", "_count"),
        }
        names |= {family.name + s for s in suffixes.get(family.type, ("",))}
    return names


def runtime_names() -> set[str]:
    """A runtime with speculative decoding on (its counters exist only then), one draft accepted at
    its first position (the per-position series exist once a position was drafted)."""
    registry = CollectorRegistry()
    EngineMetrics(registry, "qwen-7b-chat", 4096)
    SpecDecodeMetrics(registry, "qwen-7b-chat").update((1, 3, 1, (1,)))
    return scraped_names(registry)


def operator_names() -> set[str]:
    return scraped_names(OperatorMetrics().registry)


def exporter_names() -> set[str]:
    host = REPO / "tests" / "fixtures" / "xpu" / "p800-8"
    assert host.is_dir(), f"fixture host {host} missing: the exporter cannot be run"
    source = XpuSource(
        xpu_smi=str(host / "xpu-smi"), root=host / "root", kml_version_file="/usr/local/xpu/kml/VERSION"
    )
    exporter = Exporter(source, "node-a", HealthPolicy(), 3600)
    exporter.start()
    try:
        return scraped_names(exporter.registry)
    finally:
        exporter.stop()


COLLECTORS: dict[str, Callable[[], set[str]]] = {
    "runtime": runtime_names,
    "operator": operator_names,
    "exporter": exporter_names,
}


def used_names(rendered: Rendered) -> dict[str, set[str]]:
    """Metric name → where it is used ("alert X", "panel Y"), over alerts and the dashboard."""
    used: dict[str, set[str]] = {}
    for group in rendered.one("PrometheusRule")["spec"]["groups"]:
        for rule in group["rules"]:
            for name in metric_names(rule["expr"]):
                used.setdefault(name, set()).add(f"alert {rule['alert']}")
    dashboard = json.loads(rendered.one("ConfigMap", "-dashboard")["data"]["kunlun-inference.json"])
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            for name in metric_names(target["expr"]):
                used.setdefault(name, set()).add(f"panel {panel['title']}")
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            for name in label_values_metric(variable["query"]["query"]):
                used.setdefault(name, set()).add(f"variable {variable['name']}")
    return used


def owner(name: str) -> str | None:
    return next((comp for prefix, comp in OWNERS.items() if name.startswith(prefix)), None)


def test_every_used_metric_belongs_to_a_component(monitoring_render: Rendered) -> None:
    used = used_names(monitoring_render)
    orphans = {n: sorted(w) for n, w in used.items() if owner(n) is None and n not in PROMETHEUS_SYNTHETIC}
    assert orphans == {}


@pytest.mark.parametrize("component", ["runtime", "exporter", "operator"])
def test_metrics_used_by_alerts_and_dashboard_are_exported(
    component: str, monitoring_render: Rendered
) -> None:
    used = {n: w for n, w in used_names(monitoring_render).items() if owner(n) == component}
    assert used, f"the dashboard and alerts use no {component} metric"
    exported = COLLECTORS[component]()
    missing = {n: sorted(w) for n, w in used.items() if n not in exported}
    assert missing == {}, f"used but not exported by the {component}"


def test_the_dashboard_and_alerts_cover_serving_and_chip_metrics(monitoring_render: Rendered) -> None:
    used = set(used_names(monitoring_render))
    assert {
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:request_success_total",
        "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
        "kunlun_xpu_temperature_celsius",
        "kunlun_xpu_healthy",
        "kunlun_xpu_ecc_errors_total",
        "kunlun_xpu_info",
    } <= used


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('rate(a_total{x="y", le=~"1|2"}[5m])', {"a_total"}),
        (
            "histogram_quantile(0.99, sum by (le, model_name) (rate(vllm:ttft_bucket[$__rate_interval])))",
            {"vllm:ttft_bucket"},
        ),
        (
            'a * on (namespace, pod) group_left (model_name) max by (namespace, pod) (b{m=~"$model"}) / c',
            {"a", "b", "c"},
        ),
        ("count by (node) (x == 0) > 1e3 and deriv(y[10m:1m]) > 0", {"x", "y"}),
        ('up{container="runtime"} == 0 unless ignoring (pod) z offset 5m', {"up", "z"}),
    ],
)
def test_promql_name_extraction(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_label_values_query_yields_only_the_metric() -> None:
    assert label_values_metric('label_values(vllm:num_requests_running{namespace=~"$ns"}, model_name)') == {
        "vllm:num_requests_running"
    }


def test_scraped_names_expand_histograms_and_counters() -> None:
    from prometheus_client import Counter, Histogram

    registry = CollectorRegistry()
    Counter("demo_requests", "d", ["code"], registry=registry)
    Histogram("demo_latency_seconds", "d", registry=registry)
    assert {
        "demo_requests_total",
        "demo_latency_seconds_bucket",
        "demo_latency_seconds_sum",
        "demo_latency_seconds_count",
    } <= scraped_names(registry)

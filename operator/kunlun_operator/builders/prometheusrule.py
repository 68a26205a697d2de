"""The PrometheusRule: alerts on one service's availability, queue, latency and KV cache.

Every expression is scoped to the service's own series (``namespace`` and ``service`` labels the
ServiceMonitor attaches), so one rule object per service never fires for another.
"""

from __future__ import annotations

from typing import Any

from kunlun_operator import names
from kunlun_operator.builders.common import build_metadata, header
from kunlun_operator.spec.service import ServiceRef
from kunlun_operator.spec.values import InferenceSpec

TTFT_P95_SECONDS = 5
KV_CACHE_FULL_RATIO = 0.95


def _alert(name: str, expr: str, duration: str, severity: str, summary: str) -> dict[str, Any]:
    return {
        "alert": name,
        "expr": expr,
        "for": duration,
        "labels": {"severity": severity},
        "annotations": {"summary": summary},
    }


def build_prometheusrule(ref: ServiceRef, spec: InferenceSpec) -> dict[str, Any]:
    sel = f'namespace="{ref.namespace}",service="{ref.name}"'
    who = f"{ref.namespace}/{ref.name}"
    queue_limit = (
        quantity_text(2 * spec.autoscaling.effective_target)
        if spec.autoscaling.metric == "requestsWaiting"
        else "10"
    )
    rules = [
        _alert(
            "KunlunInferenceDown",
            f"absent(up{{{sel}}} == 1)",
            "5m",
            "critical",
            f"No replica of {who} is up.",
        ),
        _alert(
            "KunlunInferenceQueueBacklog",
            f"avg(vllm:num_requests_waiting{{{sel}}}) > {queue_limit}",
            "10m",
            "warning",
            f"Requests of {who} are queueing (more than {queue_limit} waiting per replica).",
        ),
        _alert(
            "KunlunInferenceSlowFirstToken",
            "histogram_quantile(0.95, sum by (le) "
            f"(rate(vllm:time_to_first_token_seconds_bucket{{{sel}}}[5m]))) > {TTFT_P95_SECONDS}",
            "10m",
            "warning",
            f"p95 time to first token of {who} is above {TTFT_P95_SECONDS}s.",
        ),
        _alert(
            "KunlunInferenceKVCacheFull",
            f"max(vllm:kv_cache_usage_perc{{{sel}}}) > {KV_CACHE_FULL_RATIO}",
            "10m",
            "warning",
            f"The KV cache of {who} is over {KV_CACHE_FULL_RATIO:.0%} full; requests get preempted.",
        ),
    ]
    return {
        **header(names.PROMETHEUS_RULE),
        "metadata": build_metadata(ref, names.PROMETHEUS_RULE, labels=spec.monitoring.labels),
        "spec": {"groups": [{"name": f"kunlun-inference.{ref.namespace}.{ref.name}", "rules": rules}]},
    }


def quantity_text(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"

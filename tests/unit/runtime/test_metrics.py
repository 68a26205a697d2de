"""vLLM-compatible metrics: names, types, labels, buckets and exact values, in a private registry."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kunlun_runtime.metrics import (
    ITL_BUCKETS_SECONDS,
    METRIC_NAMES,
    REQUEST_LATENCY_BUCKETS_SECONDS,
    TTFT_BUCKETS_SECONDS,
    CacheConfigInfo,
    FinishedRequestStats,
    StepStats,
    build_1_2_5_buckets,
    build_metrics,
)
from kunlun_runtime.platforms.base import Telemetry

VLLM_TYPES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:cache_config_info": "gauge",
}


def scrape(registry: CollectorRegistry) -> tuple[dict[str, str], dict[tuple[str, tuple], float]]:
    families = list(text_string_to_metric_families(generate_latest(registry).decode()))
    types = {family.name: family.type for family in families}
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}
    return types, values


def labels(**extra: str) -> tuple:
    return tuple(sorted({"model_name": "m", "engine": "0", **extra}.items()))


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def test_every_vllm_metric_of_the_issue_exists_with_vllm_type(registry) -> None:
    build_metrics(registry, "m", max_model_len=100).set_cache_config(
        CacheConfigInfo(16, 10, True, "bfloat16", 1)
    )
    types, _ = scrape(registry)
    for name, kind in VLLM_TYPES.items():
        assert types.get(name) == kind, name
    assert set(types) == set(METRIC_NAMES)


def test_histogram_buckets_are_vllms(registry) -> None:
    build_metrics(registry, "m", max_model_len=100)
    _, values = scrape(registry)

    def bounds(name: str) -> list[float]:
        found = [dict(lbl)["le"] for (n, lbl) in values if n == f"{name}_bucket"]
        return [float(b) for b in found if b != "+Inf"]

    assert bounds("vllm:time_to_first_token_seconds") == list(TTFT_BUCKETS_SECONDS)
    assert TTFT_BUCKETS_SECONDS[:3] == (0.001, 0.005, 0.01) and TTFT_BUCKETS_SECONDS[-1] == 2560.0
    assert bounds("vllm:inter_token_latency_seconds") == list(ITL_BUCKETS_SECONDS)
    assert bounds("vllm:time_per_output_token_seconds") == list(ITL_BUCKETS_SECONDS)
    assert bounds("vllm:e2e_request_latency_seconds") == list(REQUEST_LATENCY_BUCKETS_SECONDS)
    assert bounds("vllm:request_prompt_tokens") == [1, 2, 5, 10, 20, 50, 100]
    assert bounds("vllm:iteration_tokens_total")[:3] == [1, 8, 16]


def test_1_2_5_buckets_stop_at_the_maximum() -> None:
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(4) == [1, 2]
    assert build_1_2_5_buckets(2048)[-1] == 2000


def test_a_step_sets_gauges_and_adds_counters(registry) -> None:
    metrics = build_metrics(registry, "m")
    metrics.record_step(StepStats(3, 2, 0.25, num_prompt_tokens=10, num_generation_tokens=3, ran_step=True,
                                  num_prefix_queries=32, num_prefix_hits=16, num_preemptions=1,
                                  time_to_first_tokens_seconds=(0.003,)))  # fmt: skip
    metrics.record_step(
        StepStats(1, 0, 0.0, num_generation_tokens=1, ran_step=True, inter_token_latencies_seconds=(0.02,))
    )
    _, values = scrape(registry)
    assert values[("vllm:num_requests_running", labels())] == 1
    assert values[("vllm:num_requests_waiting", labels())] == 0
    assert values[("vllm:kv_cache_usage_perc", labels())] == 0.0
    assert values[("vllm:gpu_cache_usage_perc", labels())] == 0.0
    assert values[("vllm:prompt_tokens_total", labels())] == 10
    assert values[("vllm:generation_tokens_total", labels())] == 4
    assert values[("vllm:prefix_cache_queries_total", labels())] == 32
    assert values[("vllm:prefix_cache_hits_total", labels())] == 16
    assert values[("vllm:num_preemptions_total", labels())] == 1
    assert values[("vllm:iteration_tokens_total_count", labels())] == 2
    assert values[("vllm:iteration_tokens_total_sum", labels())] == 14
    assert values[("vllm:time_to_first_token_seconds_bucket", labels(le="0.001"))] == 0
    assert values[("vllm:time_to_first_token_seconds_bucket", labels(le="0.005"))] == 1
    assert values[("vllm:inter_token_latency_seconds_sum", labels())] == pytest.approx(0.02)
    assert values[("vllm:time_per_output_token_seconds_count", labels())] == 1


def test_an_idle_update_is_not_an_iteration(registry) -> None:
    metrics = build_metrics(registry, "m")
    metrics.record_step(StepStats(0, 0, 0.0, ran_step=False))
    _, values = scrape(registry)
    assert values[("vllm:iteration_tokens_total_count", labels())] == 0


def test_a_finished_request_counts_by_reason_and_phase(registry) -> None:
    metrics = build_metrics(registry, "m")
    metrics.record_finished(FinishedRequestStats("length", 7, 4, 0.9, 0.1, 0.2, 0.6, 0.8))
    metrics.record_finished(FinishedRequestStats("abort", 7, 0, 0.1, 0.1, 0.0, 0.0, 0.0))
    _, values = scrape(registry)
    assert values[("vllm:request_success_total", labels(finished_reason="length"))] == 1
    assert values[("vllm:request_success_total", labels(finished_reason="abort"))] == 1
    assert values[("vllm:request_success_total", labels(finished_reason="stop"))] == 0
    assert values[("vllm:e2e_request_latency_seconds_sum", labels())] == pytest.approx(1.0)
    assert values[("vllm:request_decode_time_seconds_sum", labels())] == pytest.approx(0.6)
    assert values[("vllm:request_generation_tokens_sum", labels())] == 4


def test_telemetry_sets_only_what_the_platform_reports(registry) -> None:
    metrics = build_metrics(registry, "m")
    metrics.set_telemetry(Telemetry(utilization_ratio=0.5, memory_used_bytes=10, memory_total_bytes=20))
    _, values = scrape(registry)
    assert values[("kunlun:device_utilization_ratio", labels())] == 0.5
    assert values[("kunlun:device_memory_total_bytes", labels())] == 20
    assert not [key for key in values if key[0] == "kunlun:device_temperature_celsius"]


def test_cache_config_info_is_a_gauge_set_to_one(registry) -> None:
    build_metrics(registry, "m").set_cache_config(CacheConfigInfo(16, 123, False, "float32", 1 << 20))
    _, values = scrape(registry)
    [(key, value)] = [(k, v) for k, v in values.items() if k[0] == "vllm:cache_config_info"]
    assert value == 1
    assert dict(key[1])["num_gpu_blocks"] == "123" and dict(key[1])["block_size"] == "16"


def test_two_servers_in_one_process_use_separate_registries() -> None:
    first, second = CollectorRegistry(), CollectorRegistry()
    build_metrics(first, "a").record_step(StepStats(1, 0, 0.5))
    build_metrics(second, "b")
    assert (
        scrape(second)[1][
            ("vllm:num_requests_running", tuple(sorted({"model_name": "b", "engine": "0"}.items())))
        ]
        == 0
    )

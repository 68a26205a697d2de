"""vLLM-compatible metrics: names, types, labels, buckets and exact values, in a private registry."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kunlun_runtime.config import EngineConfig, parse_memory
from kunlun_runtime.engine.llm_engine import LLMEngine
from kunlun_runtime.engine.sampling_params import SamplingParams
from kunlun_runtime.platforms.base import Telemetry
from kunlun_runtime.server.metrics import (
    ITL_BUCKETS_SECONDS,
    METRIC_NAMES,
    REQUEST_LATENCY_BUCKETS_SECONDS,
    STRUCTURED_OUTPUT_KINDS,
    TTFT_BUCKETS_SECONDS,
    CacheConfigInfo,
    FinishedRequestStats,
    StepStats,
    build_1_2_5_buckets,
    build_metrics,
)
from kunlun_runtime.server.stats import StatsRecorder
from kunlun_runtime.structured.grammar import CONSTRAINT_KINDS
from kunlun_runtime.structured.params import StructuredOutputsParams
from tests.support.tiny_models import make_tiny_model

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
    "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:cache_config_info": "gauge",
    "kunlun:structured_output_mask_seconds": "counter",
    "kunlun:structured_output_requests": "counter",
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
    assert bounds("vllm:request_params_n") == [1, 2, 5, 10, 20]
    assert bounds("vllm:request_params_max_tokens") == [1, 2, 5, 10, 20, 50, 100]


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


def test_request_params_are_observed_when_given(registry) -> None:
    metrics = build_metrics(registry, "m", max_model_len=100)
    metrics.record_finished(FinishedRequestStats("length", 7, 4, 0.9, 0.1, 0.2, 0.6, 0.8, max_tokens=4))
    metrics.record_finished(FinishedRequestStats("stop", 7, 3, 0.9, 0.1, 0.2, 0.6, 0.8, max_tokens=4, n=2))
    metrics.record_finished(FinishedRequestStats("stop", 7, 3, 0.9, 0.1, 0.2, 0.6, 0.8))  # unknown: none
    _, values = scrape(registry)
    assert values[("vllm:request_params_max_tokens_count", labels())] == 2
    assert values[("vllm:request_params_max_tokens_sum", labels())] == 8
    assert values[("vllm:request_params_n_count", labels())] == 1
    assert values[("vllm:request_params_n_bucket", labels(le="1.0"))] == 0
    assert values[("vllm:request_params_n_bucket", labels(le="2.0"))] == 1


def test_structured_output_counters_start_at_zero_for_every_kind(registry) -> None:
    assert STRUCTURED_OUTPUT_KINDS == CONSTRAINT_KINDS
    metrics = build_metrics(registry, "m")
    metrics.record_step(
        StepStats(0, 0, 0.0, structured_mask_seconds=0.25, num_structured_requests={"regex": 2})
    )
    _, values = scrape(registry)
    kinds = {
        dict(key)["kind"]: value
        for (name, key), value in values.items()
        if name == "kunlun:structured_output_requests_total"
    }
    assert kinds == {"json": 0, "json_object": 0, "regex": 2, "choice": 0, "grammar": 0}
    assert values[("kunlun:structured_output_mask_seconds_total", labels())] == 0.25


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LLMEngine:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("metrics") / "tiny")
    config = EngineConfig(
        model=str(model_dir), dtype="float32", max_model_len=32, kv_cache_memory_bytes=parse_memory("4MiB")
    )
    return LLMEngine(config)


def run_until_done(engine: LLMEngine, stats: StatsRecorder, *, abort_second: str | None = None) -> None:
    """Drive the engine and the recorder as the server's engine thread does: apply commands (here
    at most one abort, before the second step), step, record."""
    num_steps = 0
    while engine.has_unfinished_requests():
        aborted = engine.abort_request(abort_second) if abort_second and num_steps == 1 else None
        outputs = engine.step() if engine.has_unfinished_requests() else []
        num_steps += 1
        stats.record(engine, outputs + ([aborted] if aborted else []), ran_step=bool(outputs))


def test_finished_requests_report_n_once_and_their_effective_max_tokens(engine) -> None:
    registry = CollectorRegistry()
    stats = StatsRecorder(build_metrics(registry, "m", max_model_len=engine.max_model_len), engine)
    prompt = [5, 17, 99, 3, 250, 8]
    asked = SamplingParams(max_tokens=4, ignore_eos=True, seed=1)
    for index in range(3):  # one API request with n=3, as request_building.children names its requests
        engine.add_request(f"cmpl-a-{index}", prompt, asked)
    engine.add_request("cmpl-b-0", prompt, SamplingParams(max_tokens=None, ignore_eos=True))  # 32 - 6 left
    engine.add_request("cmpl-c-0", prompt, SamplingParams(max_tokens=1))  # ends in its first step
    engine.add_request("cmpl-d-0", prompt, SamplingParams(max_tokens=8, ignore_eos=True))  # aborted
    stats.expect([f"cmpl-a-{index}" for index in range(3)])  # as the engine thread announces groups
    for request_id in ("cmpl-b-0", "cmpl-c-0", "cmpl-d-0"):
        stats.expect([request_id])
    run_until_done(engine, stats, abort_second="cmpl-d-0")
    _, values = scrape(registry)
    success = {
        r: values[("vllm:request_success_total", labels(finished_reason=r))] for r in ("length", "abort")
    }
    assert success == {"length": 5, "abort": 1}
    assert values[("vllm:request_params_n_count", labels())] == 4  # a, b, c and d: n once each
    assert values[("vllm:request_params_n_sum", labels())] == 3 + 1 + 1 + 1
    assert values[("vllm:request_params_n_bucket", labels(le="1.0"))] == 3
    assert values[("vllm:request_params_n_bucket", labels(le="5.0"))] == 4
    assert values[("vllm:request_params_max_tokens_count", labels())] == 6  # one per engine request
    assert values[("vllm:request_params_max_tokens_sum", labels())] == 3 * 4 + 26 + 1 + 8
    buckets = {
        dict(key)["le"]: value
        for (name, key), value in values.items()
        if name == "vllm:request_params_max_tokens_bucket"
    }
    assert buckets == {"1.0": 1, "2.0": 1, "5.0": 4, "10.0": 5, "20.0": 5, "+Inf": 6}


def test_structured_output_requests_and_mask_time_are_counted_from_the_engine(engine) -> None:
    registry = CollectorRegistry()
    stats = StatsRecorder(build_metrics(registry, "m", max_model_len=engine.max_model_len), engine)
    choice = StructuredOutputsParams(choice=("yes", "no"))
    engine.add_request("chat-s-0", [5, 17, 99], SamplingParams(max_tokens=8, structured_outputs=choice))
    engine.add_request("chat-t-0", [5, 17, 99], SamplingParams(max_tokens=2))
    run_until_done(engine, stats)
    _, values = scrape(registry)
    kinds = {
        dict(key)["kind"]: value
        for (name, key), value in values.items()
        if name == "kunlun:structured_output_requests_total"
    }
    assert kinds == {"json": 0, "json_object": 0, "regex": 0, "choice": 1, "grammar": 0}
    mask_seconds = values[("kunlun:structured_output_mask_seconds_total", labels())]
    assert 0 < mask_seconds == pytest.approx(engine.structured.mask_seconds_total)
    assert values[("vllm:request_params_max_tokens_sum", labels())] == 8 + 2


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

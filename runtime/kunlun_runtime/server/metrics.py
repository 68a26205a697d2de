"""vLLM-compatible Prometheus metrics, plus the platform's telemetry under ``kunlun:``.

Names, types, help texts' meaning, histogram buckets and labels (``model_name``, ``engine``) follow
vLLM v1's Prometheus logger, so dashboards, routers and autoscalers written for vLLM read them
unchanged; ``vllm:gpu_cache_usage_perc`` stays as the deprecated alias of
``vllm:kv_cache_usage_perc``. Structured outputs have no vLLM metric: theirs are ours, under
``kunlun:structured_output_*``. Every collector is built into the ``CollectorRegistry`` it is given
(never the global one), so several servers and the tests can live in one process.

This module only turns plain numbers into metrics: it never imports the engine. The server feeds it
one ``StepStats`` per engine step and one ``FinishedRequestStats`` per finished request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

ENGINE_INDEX = "0"
FINISHED_REASONS = ("stop", "length", "abort")

TTFT_BUCKETS_SECONDS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS_SECONDS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS_SECONDS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
# The constraint kinds of structured outputs (structured.grammar.CONSTRAINT_KINDS, not imported:
# this module stays free of the engine); each is a labelled series from the start, at 0.
STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar")

# Exposed family names (what a scrape shows before the _bucket/_total suffixes of the samples).
METRIC_NAMES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:num_preemptions",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:iteration_tokens_total",
    "vllm:request_params_n",
    "vllm:request_params_max_tokens",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:cache_config_info",
    "kunlun:runtime_info",
    "kunlun:structured_output_mask_seconds",
    "kunlun:structured_output_requests",
    "kunlun:kv_event_batches_dropped",
    "kunlun:device_utilization_ratio",
    "kunlun:device_memory_used_bytes",
    "kunlun:device_memory_total_bytes",
    "kunlun:device_temperature_celsius",
    "kunlun:device_power_watts",
)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to and including ``max_value`` (vLLM's token-count buckets)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


@dataclass(frozen=True, slots=True)
class StepStats:
    """What one engine step (or an idle moment) changed; counters are increments, gauges levels."""

    num_running: int
    num_waiting: int
    kv_cache_usage_ratio: float
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    num_prefix_queries: int = 0
    num_prefix_hits: int = 0
    ran_step: bool = False  # False: only gauges changed (e.g. after an abort), no iteration happened
    time_to_first_tokens_seconds: tuple[float, ...] = ()
    inter_token_latencies_seconds: tuple[float, ...] = ()
    structured_mask_seconds: float = 0.0  # computing structured-output allowed-token masks
    num_structured_requests: Mapping[str, int] = field(default_factory=dict)  # by constraint kind
    num_kv_event_batches_dropped: int = 0  # KV event batches dropped from the publisher's full queue


@dataclass(frozen=True, slots=True)
class FinishedRequestStats:
    finished_reason: str  # "stop" | "length" | "abort"
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_seconds: float
    queue_seconds: float
    prefill_seconds: float
    decode_seconds: float
    inference_seconds: float
    # The effective max_tokens: as asked, or what the context leaves (vLLM observes the same);
    # None when unknown, and then not observed.
    max_tokens: int | None = None
    # The n of the API request this one is a choice of, given on the last of its n requests to
    # finish (vLLM observes n once per API request); None on the others.
    n: int | None = None


@dataclass(frozen=True, slots=True)
class CacheConfigInfo:
    block_size: int
    num_gpu_blocks: int
    enable_prefix_caching: bool
    cache_dtype: str
    kv_cache_memory_bytes: int


class EngineMetrics:
    """The collectors of one served model, bound to its ``model_name`` and engine ``0`` labels."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        labels = ("model_name", "engine")
        values = (model_name, ENGINE_INDEX)
        self.registry = registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=registry).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=registry).labels(*values)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, registry=registry, buckets=buckets).labels(*values)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.gpu_usage = gauge(
            "vllm:gpu_cache_usage_perc",
            "GPU KV-cache usage. 1 means 100 percent usage. "
            "DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
        )
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            (*labels, "finished_reason"),
            registry=registry,
        )
        self.success = {reason: success.labels(*values, reason) for reason in FINISHED_REASONS}
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_TOKENS_BUCKETS,
        )
        self.request_params_n = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", REQUEST_PARAMS_N_BUCKETS
        )
        self.request_params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", token_buckets
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS_SECONDS,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS_SECONDS,
        )
        # Deprecated in vLLM for vllm:inter_token_latency_seconds but still on its stock Grafana
        # dashboard; vLLM v1 observes the same per-token intervals into both.
        self.tpot = histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.",
            ITL_BUCKETS_SECONDS,
        )
        phases = {
            "e2e": ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."),
            "queue": (
                "vllm:request_queue_time_seconds",
                "Histogram of time spent in WAITING phase for request.",
            ),
            "inference": (
                "vllm:request_inference_time_seconds",
                "Histogram of time spent in RUNNING phase for request.",
            ),
            "prefill": (
                "vllm:request_prefill_time_seconds",
                "Histogram of time spent in PREFILL phase for request.",
            ),
            "decode": (
                "vllm:request_decode_time_seconds",
                "Histogram of time spent in DECODE phase for request.",
            ),
        }
        self.phase = {
            key: histogram(name, doc, REQUEST_LATENCY_BUCKETS_SECONDS) for key, (name, doc) in phases.items()
        }
        self._cache_info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            (
                "block_size",
                "cache_dtype",
                "enable_prefix_caching",
                "kv_cache_memory_bytes",
                "num_gpu_blocks",
                "engine",
            ),
            registry=registry,
        )
        # What the engine computes with, as vllm:cache_config_info carries the cache's settings:
        # one series set to 1, its labels the facts (a fallback to a slower backend shows here).
        self._runtime_info = Gauge(
            "kunlun:runtime_info",
            "The engine's linear backend, kernel tier, compute dtype and KV-cache dtype (value 1).",
            (*labels, "backend", "tier", "dtype", "kv_dtype"),
            registry=registry,
        )
        self.structured_mask_seconds = counter(
            "kunlun:structured_output_mask_seconds",
            "Time spent computing the allowed-token masks of structured outputs, in seconds.",
        )
        self._structured_requests = Counter(
            "kunlun:structured_output_requests",
            "Requests started with a structured-output constraint, by constraint kind.",
            (*labels, "kind"),
            registry=registry,
        )
        for kind in STRUCTURED_OUTPUT_KINDS:
            self._structured_requests.labels(*values, kind)
        self.kv_event_batches_dropped = counter(
            "kunlun:kv_event_batches_dropped",
            "KV cache event batches dropped because the publisher's queue was full (max_queue_size); "
            "each is a sequence number subscribers never receive.",
        )
        # Labelled only once the platform reports a value: an absent reading is no sample, not 0.
        device = {
            "utilization_ratio": (
                "kunlun:device_utilization_ratio",
                "Accelerator (or CPU) utilisation, 0..1.",
            ),
            "memory_used_bytes": ("kunlun:device_memory_used_bytes", "Device memory in use, bytes."),
            "memory_total_bytes": ("kunlun:device_memory_total_bytes", "Device memory in total, bytes."),
            "temperature_celsius": (
                "kunlun:device_temperature_celsius",
                "Device temperature, degrees Celsius.",
            ),
            "power_watts": ("kunlun:device_power_watts", "Device power draw, watts."),
        }
        self._label_values = values
        self.device = {
            key: Gauge(name, doc, labels, registry=registry) for key, (name, doc) in device.items()
        }

    def set_cache_config(self, info: CacheConfigInfo) -> None:
        self._cache_info.labels(
            block_size=str(info.block_size),
            cache_dtype=info.cache_dtype,
            enable_prefix_caching=str(info.enable_prefix_caching),
            kv_cache_memory_bytes=str(info.kv_cache_memory_bytes),
            num_gpu_blocks=str(info.num_gpu_blocks),
            engine=ENGINE_INDEX,
        ).set(1)

    def set_runtime_info(self, *, backend: str, tier: str, dtype: str, kv_dtype: str) -> None:
        """``kunlun:runtime_info``: one series, the engine's backend, kernel tier and dtypes."""
        self._runtime_info.clear()
        self._runtime_info.labels(*self._label_values, backend, tier, dtype, kv_dtype).set(1)

    def record_step(self, stats: StepStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage_ratio)
        self.gpu_usage.set(stats.kv_cache_usage_ratio)
        self.prefix_queries.inc(stats.num_prefix_queries)
        self.prefix_hits.inc(stats.num_prefix_hits)
        self.preemptions.inc(stats.num_preemptions)
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens)
        if stats.ran_step:
            self.iteration_tokens.observe(stats.num_prompt_tokens + stats.num_generation_tokens)
        for seconds in stats.time_to_first_tokens_seconds:
            self.ttft.observe(seconds)
        for seconds in stats.inter_token_latencies_seconds:
            self.itl.observe(seconds)
            self.tpot.observe(seconds)
        self.structured_mask_seconds.inc(stats.structured_mask_seconds)
        for kind, count in stats.num_structured_requests.items():
            self._structured_requests.labels(*self._label_values, kind).inc(count)
        self.kv_event_batches_dropped.inc(stats.num_kv_event_batches_dropped)

    def record_finished(self, stats: FinishedRequestStats) -> None:
        self.success[stats.finished_reason].inc()
        self.request_prompt_tokens.observe(stats.num_prompt_tokens)
        self.request_generation_tokens.observe(stats.num_generation_tokens)
        if stats.max_tokens:
            self.request_params_max_tokens.observe(stats.max_tokens)
        if stats.n is not None:
            self.request_params_n.observe(stats.n)
        self.phase["e2e"].observe(stats.e2e_seconds)
        self.phase["queue"].observe(stats.queue_seconds)
        self.phase["inference"].observe(stats.inference_seconds)
        self.phase["prefill"].observe(stats.prefill_seconds)
        self.phase["decode"].observe(stats.decode_seconds)

    def set_telemetry(self, telemetry: object) -> None:
        """Set the ``kunlun:device_*`` gauges from a platform Telemetry; fields that are None stay unset."""
        for field_name, parent in self.device.items():
            value = getattr(telemetry, field_name, None)
            if value is not None:
                parent.labels(*self._label_values).set(value)


def build_metrics(
    registry: CollectorRegistry, model_name: str, *, max_model_len: int = 8192
) -> EngineMetrics:
    """Build every metric of one served model into ``registry``.

    Like vLLM, this turns off prometheus_client's ``*_created`` series (process-wide): dashboards
    written for vLLM neither expect nor need them.
    """
    disable_created_metrics()
    return EngineMetrics(registry, model_name, max_model_len)

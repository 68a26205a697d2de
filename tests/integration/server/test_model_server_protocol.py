"""The Gateway API Inference Extension's model-server protocol, read from a live server as its
Endpoint Picker reads it: ``GET /metrics`` with no credentials, parsed as Prometheus text, one
series per family (the picker takes the first that matches), gauges for the queue, the batch and
the KV-cache use, and ``vllm:cache_config_info`` whose labels carry the block size and the pool's
block count. Under a load larger than the batch (``max_num_seqs``), the gauges must show the batch
full, the rest queued, KV blocks in use, and everything back to 0 once the load has finished.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.server.live import API_KEY, LiveServer, serve_in_thread
from tests.support.waiting import wait_for

MAX_NUM_SEQS = 2
NUM_REQUESTS = 5  # more than the batch holds: MAX_NUM_SEQS run, the others wait
BLOCK_SIZE = 8  # not the default (16), so the label cannot match by accident
MAX_TOKENS = 256  # long enough that the whole load is admitted while the first requests still run
QUEUE = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
CACHE_INFO = "vllm:cache_config_info"
PROTOCOL_GAUGES = (QUEUE, RUNNING, KV_USAGE, CACHE_INFO)


@dataclass(frozen=True, slots=True)
class Reading:
    """One scrape's protocol gauges (the picker's WaitingQueueSize, RunningRequestsSize,
    KVCacheUsagePercent, CacheBlockSize and CacheNumBlocks)."""

    waiting: float
    running: float
    kv_usage: float
    cache_info: dict[str, str]


def read_protocol(base_url: str) -> Reading:
    """Scrape as the picker does (plain GET, no Authorization header) and check each protocol
    family's type and that it has exactly one series."""
    response = httpx.get(f"{base_url}/metrics", timeout=10)
    assert response.status_code == 200, response.text
    families = {family.name: family for family in text_string_to_metric_families(response.text)}
    for name in PROTOCOL_GAUGES:
        assert families[name].type == "gauge", (name, families[name].type)
        assert len(families[name].samples) == 1, (name, families[name].samples)
    (info,) = families[CACHE_INFO].samples
    assert info.value == 1  # an info gauge: the facts are its labels

    def value(name: str) -> float:
        return families[name].samples[0].value

    return Reading(value(QUEUE), value(RUNNING), value(KV_USAGE), dict(info.labels))


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[LiveServer]:
    # An API key, so the scrapes also show that /metrics needs none (the picker sends none).
    with serve_in_thread(
        tiny_model_dir, api_key=API_KEY, max_num_seqs=MAX_NUM_SEQS, block_size=BLOCK_SIZE
    ) as live:
        yield live


def stream_one(server: LiveServer, index: int) -> int:
    """One streamed chat request of MAX_TOKENS tokens through the OpenAI client; its chunk count."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    stream = client.chat.completions.create(
        model=server.model_name,
        messages=[{"role": "user", "content": f"tell story number {index}"}],
        max_tokens=MAX_TOKENS,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = sum(1 for _ in stream)
    client.close()
    return chunks


def test_idle_server_reports_empty_queues_and_its_pool_as_cache_config_info(server) -> None:
    reading = read_protocol(server.base_url)
    assert (reading.waiting, reading.running, reading.kv_usage) == (0, 0, 0)
    runtime = httpx.get(f"{server.base_url}/version", timeout=10).json()["runtime"]
    num_kv_tokens = runtime["num_kv_tokens"]  # the pool's capacity, as the start line states it
    assert reading.cache_info["block_size"] == str(BLOCK_SIZE)
    assert int(reading.cache_info["num_gpu_blocks"]) * BLOCK_SIZE == num_kv_tokens
    assert reading.cache_info["enable_prefix_caching"] == "True"


def test_gauges_show_the_batch_full_the_rest_queued_and_all_clear_after(server) -> None:
    readings: list[Reading] = []

    def scrape_until(predicate, message: str) -> Reading:
        def probe() -> Reading | None:
            reading = read_protocol(server.base_url)
            readings.append(reading)
            return reading if predicate(reading) else None

        return wait_for(probe, timeout_seconds=120.0, message=message)

    with concurrent.futures.ThreadPoolExecutor(NUM_REQUESTS) as pool:
        futures = [pool.submit(stream_one, server, index) for index in range(NUM_REQUESTS)]
        full = scrape_until(
            lambda r: r.running == MAX_NUM_SEQS and r.waiting == NUM_REQUESTS - MAX_NUM_SEQS,
            "the batch full and the rest of the load queued",
        )
        assert full.kv_usage > 0  # the running requests hold KV blocks
        # As requests finish, the queue drains into the batch and nothing new arrives.
        scrape_until(
            lambda r: r.waiting == 0 and r.running > 0, "the queue drained, the last requests running"
        )
        chunk_counts = [future.result(timeout=300) for future in futures]
    assert all(count > 0 for count in chunk_counts)
    # The last step's gauges are published before its outputs reach the clients: no wait needed.
    after = read_protocol(server.base_url)
    assert (after.waiting, after.running, after.kv_usage) == (0, 0, 0)
    peak = readings.index(full)
    assert all(0 <= r.running <= MAX_NUM_SEQS for r in readings)
    assert all(0 <= r.waiting <= NUM_REQUESTS - MAX_NUM_SEQS for r in readings)
    assert all(0.0 <= r.kv_usage <= 1.0 for r in readings)
    waiting_after_peak = [r.waiting for r in readings[peak:]]
    assert waiting_after_peak == sorted(waiting_after_peak, reverse=True)  # only ever drains
    assert all(r.cache_info == after.cache_info for r in readings)  # the pool does not change

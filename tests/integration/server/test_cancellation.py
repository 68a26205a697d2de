"""Clients that go away: their requests are aborted and every KV block comes back."""

from __future__ import annotations

import asyncio
import gc
import random

import httpx
import openai

from tests.integration.server.live import LiveServer, sample, scrape
from tests.support.waiting import wait_for

NUM_STREAMS = 50
LONG = {"ignore_eos": True}


def idle(server: LiveServer) -> dict | None:
    metrics = scrape(server.base_url)
    model = {"model_name": server.model_name}
    busy = sample(metrics, "vllm:num_requests_running", **model) + sample(
        metrics, "vllm:num_requests_waiting", **model
    )
    return metrics if busy == 0 else None


def finished_count(metrics: dict, server: LiveServer) -> float:
    return sum(
        sample(metrics, "vllm:request_success_total", model_name=server.model_name, finished_reason=reason)
        for reason in ("stop", "length", "abort")
    )


async def test_streams_cancelled_at_random_points_leave_no_running_request_and_no_block(live_server) -> None:
    before = wait_for(lambda: idle(live_server), timeout_seconds=60.0, message="an idle server")
    client = openai.AsyncOpenAI(
        base_url=f"{live_server.base_url}/v1", api_key=live_server.api_key, max_retries=0
    )
    rng = random.Random(1234)

    async def one(chunks_to_read: int) -> None:
        stream = await client.chat.completions.create(
            model=live_server.model_name,
            messages=[{"role": "user", "content": f"story {chunks_to_read}"}],
            max_tokens=400,
            stream=True,
            extra_body=LONG,
        )
        read = 0
        async for _ in stream:
            read += 1
            if read >= chunks_to_read:
                break
        await stream.close()

    # A stream left by `break` is a cycle of async generators (the client's and httpx's). A
    # collection on one of the in-process server's threads would finalise them there, racing
    # this loop's own clean-up of the same generators ("async generator already executing");
    # collected on this thread, each one's aclose runs as a task of this loop, and not in a
    # later test.
    gc.disable()
    try:
        await asyncio.gather(*(one(rng.randint(1, 12)) for _ in range(NUM_STREAMS)))
        await client.close()
    finally:
        gc.enable()
    gc.collect()
    await asyncio.sleep(0)  # the finalised generators' aclose tasks
    after = await asyncio.to_thread(
        wait_for, lambda: idle(live_server), timeout_seconds=60.0, message="the aborts to land"
    )
    model = {"model_name": live_server.model_name}
    assert sample(after, "vllm:num_requests_running", **model) == 0
    assert sample(after, "vllm:kv_cache_usage_perc", **model) == 0
    assert finished_count(after, live_server) - finished_count(before, live_server) == NUM_STREAMS
    aborted = sample(after, "vllm:request_success_total", finished_reason="abort", **model) - sample(
        before, "vllm:request_success_total", finished_reason="abort", **model
    )
    assert aborted >= 1


async def test_a_non_streaming_client_that_disconnects_aborts_its_request(live_server) -> None:
    before = wait_for(lambda: idle(live_server), timeout_seconds=60.0, message="an idle server")
    body = {"model": live_server.model_name, "prompt": "once", "max_tokens": 480, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=live_server.base_url, headers=live_server.headers) as http:
        task = asyncio.ensure_future(http.post("/v1/completions", json=body, timeout=120))
        running = {"model_name": live_server.model_name}
        await asyncio.to_thread(
            wait_for,
            lambda: sample(scrape(live_server.base_url), "vllm:num_requests_running", **running) == 1,
            timeout_seconds=60.0,
            message="the request to run",
        )
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    after = await asyncio.to_thread(
        wait_for, lambda: idle(live_server), timeout_seconds=60.0, message="the abort to land"
    )
    model = {"model_name": live_server.model_name}
    aborted = sample(after, "vllm:request_success_total", finished_reason="abort", **model) - sample(
        before, "vllm:request_success_total", finished_reason="abort", **model
    )
    assert aborted == 1
    assert sample(after, "vllm:kv_cache_usage_perc", **model) == 0

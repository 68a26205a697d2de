"""Backpressure and lifecycle: a full queue answers 429 with Retry-After and the server lives on;
SIGTERM lets in-flight requests finish, answers 503 meanwhile, and exits 0."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import threading
from pathlib import Path

import httpx
import openai

from tests.integration.server.live import health_status, sample, scrape, serve_in_thread, start_serve_process
from tests.support.waiting import wait_for

BURST = 12
# The SIGTERM test's three streams, one decoding at a time: the first long enough that the other
# two are surely waiting behind it when the test looks, and the drain outlasts the test's checks on
# a fast machine (the tiny model's context holds 512 positions).
SHUTDOWN_TOKENS = (400, 60, 60)
# The console script's entry point, run by this interpreter (``-m kunlun_runtime.commands.cli`` would load the
# CLI module twice, once as __main__, and miss the subcommands registered on the other copy).


async def test_a_burst_beyond_max_queue_len_is_refused_with_retry_after_and_the_server_lives_on(
    tiny_model_dir: Path,
) -> None:
    with serve_in_thread(tiny_model_dir, max_queue_len=2, max_num_seqs=1) as server:
        body = {"model": server.model_name, "prompt": "go", "max_tokens": 200, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
            responses = await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(BURST)))
            refused = [r for r in responses if r.status_code != 200]
            assert refused, "nothing was refused"
            assert {r.status_code for r in refused} == {429}
            for response in refused:
                assert int(response.headers["Retry-After"]) >= 1
                assert response.json()["error"]["type"] == "RateLimitError"
            for response in responses:
                if response.status_code == 200:
                    assert response.json()["usage"]["completion_tokens"] == 200
            assert (await http.get("/health")).status_code == 200
            after = await http.post("/v1/completions", json={**body, "max_tokens": 3})
            assert after.status_code == 200


def test_sigterm_lets_in_flight_requests_finish_then_exits_zero(tiny_model_dir: Path) -> None:
    process, base_url = start_serve_process(
        tiny_model_dir, "--max-num-seqs", "1", "--shutdown-timeout", "60", stdout=subprocess.PIPE
    )
    try:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
        started = [threading.Event() for _ in range(3)]
        results: list[tuple[int, str | None] | BaseException] = [None] * 3  # type: ignore[list-item]

        def stream(index: int) -> None:
            try:
                chunks = client.completions.create(
                    model=tiny_model_dir.name, prompt="go", max_tokens=SHUTDOWN_TOKENS[index], stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                )  # fmt: skip
                finish = None
                for chunk in chunks:
                    started[index].set()
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finish = chunk.choices[0].finish_reason
                    if chunk.usage:
                        results[index] = (chunk.usage.completion_tokens, finish)
            except BaseException as error:  # reported by the assertions below
                results[index] = error
                started[index].set()

        # SIGTERM once the long first stream decodes and the other two wait behind it (one sequence
        # at a time): two outputs and most of the first are still to come, so the drain lasts while
        # /health and a new request are checked. (Signalled once every stream had started, only the
        # last one's remainder was left: it could finish, and the server exit, before the new
        # request was sent.)
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        threads[0].start()
        wait_for(started[0].is_set, timeout_seconds=60.0, message="the first stream to start")
        for thread in threads[1:]:
            thread.start()

        def two_waiting() -> bool:
            metrics = scrape(base_url)
            model = {"model_name": tiny_model_dir.name}
            return (
                sample(metrics, "vllm:num_requests_running", **model),
                sample(metrics, "vllm:num_requests_waiting", **model),
            ) == (1, 2)

        wait_for(two_waiting, timeout_seconds=60.0, message="one stream decoding, two waiting")
        process.send_signal(signal.SIGTERM)
        wait_for(
            lambda: health_status(base_url) in (503, None),
            timeout_seconds=30.0,
            message="/health to turn 503",
        )
        refused = httpx.post(f"{base_url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30)
        assert refused.status_code == 503 and refused.headers["Retry-After"]
        for thread in threads:
            thread.join(120)
        assert results == [(tokens, "length") for tokens in SHUTDOWN_TOKENS]
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)

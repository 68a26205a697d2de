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

from tests.integration.server.live import health_status, serve_in_thread, start_serve_process
from tests.support.waiting import wait_for

BURST = 12
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
                    model=tiny_model_dir.name, prompt="go", max_tokens=120, stream=True,
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

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        wait_for(
            lambda: all(event.is_set() for event in started),
            timeout_seconds=60.0,
            message="every stream to start",
        )
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
        assert results == [(120, "length")] * 3
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)

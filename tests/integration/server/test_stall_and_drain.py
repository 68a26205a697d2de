"""A stuck engine step and a drain that runs out of time: every open request still gets a clean end.

The engine is real except that its step blocks on an event while a marked request is scheduled
(``max_tokens == GATED_MAX_TOKENS``), standing in for a hung device call. The watchdog then turns
/health 503, ends every stream with an error event and ``[DONE]``, and calls the exit hook after
the grace period; a drain past its timeout ends streams the same way and answers non-streaming
requests with a JSON 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from kunlun_runtime.engine.llm_engine import LLMEngine
from kunlun_runtime.engine.outputs import RequestOutput
from kunlun_runtime.server.lifecycle import Lifecycle
from kunlun_runtime.server.watchdog import EngineStalledError
from tests.integration.server.live import (
    SERVE_MAIN,
    LiveServer,
    health_status,
    serve_in_thread,
    start_serve_process,
)
from tests.support.waiting import wait_for

GATED_MAX_TOKENS = 17
STALL_TIMEOUT_SECONDS = 1.0
STALL_GRACE_SECONDS = 0.3


class GatedStepEngine(LLMEngine):
    """Its step blocks on ``gate`` while a request with ``GATED_MAX_TOKENS`` is scheduled."""

    gate = threading.Event()

    def step(self) -> list[RequestOutput]:
        pending = self.scheduler.waiting + self.scheduler.running
        if any(r.params.max_tokens == GATED_MAX_TOKENS for r in pending):
            self.gate.wait(120)
        return super().step()


@contextlib.contextmanager
def gated_server(tiny_model_dir: Path, lifecycle_options: dict[str, Any]) -> Iterator[LiveServer]:
    """A live server on a ``GatedStepEngine``; the gate opens before the server stops, so the
    blocked engine thread can finish and stop with it."""
    GatedStepEngine.gate.clear()
    with serve_in_thread(
        tiny_model_dir, engine_class=GatedStepEngine, lifecycle_options=lifecycle_options
    ) as server:
        try:
            yield server
        finally:
            GatedStepEngine.gate.set()


def stream_lines(server: LiveServer, body: dict, lines: list[str]) -> None:
    """Read a streamed completion's SSE lines into ``lines`` (until the server ends the stream)."""
    url = f"{server.base_url}/v1/completions"
    with httpx.stream(
        "POST", url, json={**body, "stream": True}, headers=server.headers, timeout=60
    ) as reply:
        lines.extend(line for line in reply.iter_lines() if line)


def error_of(line: str) -> dict:
    assert line.startswith("data: {"), line
    return httpx.Response(200, content=line.removeprefix("data: ")).json()["error"]


def test_a_stalled_engine_turns_unhealthy_ends_streams_and_calls_the_exit_hook(
    tiny_model_dir: Path,
) -> None:
    fatal: list[BaseException] = []
    options = {
        "engine_stall_timeout_seconds": STALL_TIMEOUT_SECONDS,
        "engine_stall_grace_seconds": STALL_GRACE_SECONDS,
        "on_fatal": fatal.append,
    }
    with gated_server(tiny_model_dir, options) as server:
        assert post_completion(server, {"prompt": "the", "max_tokens": 3}).status_code == 200  # not stalled
        lines: list[str] = []
        reader = threading.Thread(
            target=stream_lines, args=(server, {"prompt": "the", "max_tokens": GATED_MAX_TOKENS}, lines)
        )
        reader.start()
        assert server.lifecycle is not None and server.lifecycle.served is not None
        engine = server.lifecycle.served.engine
        wait_for(lambda: engine.num_active == 1, timeout_seconds=60.0, message="the stream in flight")
        waiting = post_completion(server, {"prompt": "the", "max_tokens": 2})
        reader.join(60)
        assert waiting.status_code == 500 and "no engine step finished" in waiting.json()["error"]["message"]
        assert lines[-1] == "data: [DONE]"
        error = error_of(lines[-2])
        assert (error["type"], error["code"]) == ("InternalServerError", 500)
        assert "no engine step finished" in error["message"]
        assert health_status(server.base_url) == 503
        wait_for(lambda: fatal, timeout_seconds=30.0, message="the exit hook")
        assert [type(e) for e in fatal] == [EngineStalledError]


# The same stand-in for a hung device call, installed in a real ``kunlun-runtime serve`` process:
# its step never returns once a request with GATED_MAX_TOKENS is scheduled.
HUNG_STEP_MAIN = f"""
import threading
from kunlun_runtime.engine.llm_engine import LLMEngine
unblocked_step = LLMEngine.step
def step(self):
    if any(r.params.max_tokens == {GATED_MAX_TOKENS} for r in self.scheduler.waiting + self.scheduler.running):
        threading.Event().wait()
    return unblocked_step(self)
LLMEngine.step = step
{SERVE_MAIN}
"""


def test_a_serve_process_whose_step_hangs_exits_1_after_the_grace_period(tiny_model_dir: Path) -> None:
    process, base_url = start_serve_process(
        tiny_model_dir,
        "--engine-stall-timeout-seconds", str(STALL_TIMEOUT_SECONDS),
        "--engine-stall-grace-seconds", str(STALL_GRACE_SECONDS),
        main=HUNG_STEP_MAIN,
    )  # fmt: skip
    try:
        model = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "prompt": "the", "max_tokens": GATED_MAX_TOKENS}
        stuck = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
        assert stuck.status_code == 500 and "no engine step finished" in stuck.json()["error"]["message"]
        # Exit 1 although the engine thread is still blocked: Kubernetes restarts the container.
        assert process.wait(timeout=60) == 1
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)
    with contextlib.suppress(httpx.TransportError):
        httpx.get(f"{base_url}/health", timeout=2)
        raise AssertionError("the server still answers after it exited")


def post_completion(server: LiveServer, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/completions", json=body, headers=server.headers, timeout=60)


async def test_at_the_drain_timeout_streams_end_with_an_error_and_done_and_others_get_a_json_503(
    tiny_model_dir: Path,
) -> None:
    with gated_server(tiny_model_dir, {}) as server:
        lifecycle = server.lifecycle
        assert isinstance(lifecycle, Lifecycle) and lifecycle.served is not None
        engine = lifecycle.served.engine
        lines: list[str] = []
        body = {"prompt": "the", "max_tokens": GATED_MAX_TOKENS}
        streaming = asyncio.create_task(asyncio.to_thread(stream_lines, server, body, lines))
        await asyncio.to_thread(
            wait_for,
            lambda: engine.num_active == 1 and engine.stalled_seconds() > 0,
            timeout_seconds=60.0,
            message="the stream to hold the engine",
        )
        plain = asyncio.create_task(asyncio.to_thread(post_completion, server, body))  # waits in the inbox
        await asyncio.to_thread(
            wait_for, lambda: engine.num_active == 2, timeout_seconds=60.0, message="both requests in flight"
        )
        assert engine.loop is not None
        drained = asyncio.run_coroutine_threadsafe(lifecycle.drain(0.5), engine.loop)
        await asyncio.wrap_future(drained)
        await streaming
        response = await plain
        assert response.status_code == 503 and response.headers["Retry-After"]
        assert response.json()["error"]["type"] == "ServiceUnavailableError"
        assert "did not finish within 0.5 s" in response.json()["error"]["message"]
        assert lines[-1] == "data: [DONE]"
        error = error_of(lines[-2])
        assert (error["type"], error["code"]) == ("ServiceUnavailableError", 503)
        assert engine.num_active == 0

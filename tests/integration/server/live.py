"""Live servers for the server's integration tests: real uvicorn on 127.0.0.1, a tiny model.

``serve_in_thread`` runs ``create_app`` under uvicorn in a background thread (its own event loop)
on a free port and waits, polling /health with a deadline, until the model is loaded and warmed
up. The session's shared server requires an API key, so every test also exercises auth.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from kunlun_runtime.config import EngineConfig
from kunlun_runtime.engine.llm_engine import LLMEngine
from kunlun_runtime.server.app import create_app
from kunlun_runtime.server.lifecycle import Lifecycle
from tests.support.waiting import wait_for

API_KEY = "test-key"
READY_DEADLINE_SECONDS = 300.0  # generous: shared CI machines can be very busy


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def health_status(base_url: str) -> int | None:
    try:
        return httpx.get(f"{base_url}/health", timeout=5).status_code
    except httpx.TransportError:
        return None


def scrape(base_url: str, headers: dict[str, str] | None = None) -> dict[tuple[str, tuple], float]:
    """/metrics as {(sample name, sorted labels): value}, parsed by prometheus_client's parser."""
    response = httpx.get(f"{base_url}/metrics", headers=headers, timeout=10)
    assert response.status_code == 200, response.text
    text = response.text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def sample(metrics: dict, name: str, **labels: str) -> float:
    matches = [v for (n, l), v in metrics.items() if n == name and set(labels.items()) <= set(l)]
    assert len(matches) == 1, f"{name}{labels}: {len(matches)} samples"
    return matches[0]


@dataclass
class LiveServer:
    base_url: str
    model_name: str
    model_dir: Path
    api_key: str | None
    lifecycle: Lifecycle | None = None  # the app's, to reach the engine or drive a drain

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@contextlib.contextmanager
def serve_in_thread(
    model_dir: Path,
    *,
    api_key: str | None = None,
    max_queue_len: int | None = None,
    engine_class: type[LLMEngine] = LLMEngine,
    app_options: dict[str, Any] | None = None,
    lifecycle_options: dict[str, Any] | None = None,
    **engine_options: object,
) -> Iterator[LiveServer]:
    """``app_options`` go to ``create_app`` (tenants, limits), ``lifecycle_options`` to its
    ``Lifecycle`` (prompt limit, watchdog), ``engine_options`` to EngineConfig."""
    config = EngineConfig(
        **{"model": str(model_dir), "dtype": "float32", "kv_cache_memory_bytes": 16 << 20, **engine_options}
    )

    def factory() -> LLMEngine:
        return engine_class(config.validate())

    lifecycle = None
    if lifecycle_options is not None:
        lifecycle = Lifecycle(factory, max_queue_len=max_queue_len, **lifecycle_options)
    app = create_app(
        factory,
        max_queue_len=max_queue_len,
        api_key=api_key,
        lifecycle=lifecycle,
        **(app_options or {}),
    )
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_for(
            lambda: health_status(base_url) == 200,
            timeout_seconds=READY_DEADLINE_SECONDS,
            message="the server to become ready",
        )
        yield LiveServer(base_url, model_dir.name, model_dir, api_key, app.state.lifecycle)
    finally:
        server.should_exit = True
        thread.join(30)


SERVE_MAIN = "import sys; from kunlun_runtime.commands.cli import main; sys.exit(main())"


def start_serve_process(
    model_dir: Path, *extra_args: str, stdout: int | None = subprocess.DEVNULL, main: str = SERVE_MAIN
) -> tuple[subprocess.Popen[bytes], str]:
    """A real ``kunlun-runtime serve`` process on a free loopback port, once /health answers 200;
    returns it and its base URL. The caller stops it; a server that never gets ready is killed.
    ``main``: the ``python -c`` program that runs the CLI (a test may prepare the process first)."""
    port = free_port()
    command = [
        sys.executable, "-c", main, "serve", "--model", str(model_dir), "--dtype", "float32",
        "--kv-cache-memory", "16MiB", "--host", "127.0.0.1", "--port", str(port), *extra_args,
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=stdout, stderr=subprocess.STDOUT, env=os.environ.copy())
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_for(
            lambda: health_status(base_url) == 200,
            timeout_seconds=300.0,
            message="the server to become ready",
        )
    except BaseException:
        process.kill()
        process.wait(timeout=30)
        raise
    return process, base_url

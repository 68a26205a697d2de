"""Readiness: /health and the API answer 503 (with Retry-After) until the model is loaded and warm."""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import httpx
import uvicorn

from kunlun_runtime.config import EngineConfig
from kunlun_runtime.engine.llm_engine import LLMEngine
from kunlun_runtime.errors import ModelLoadError
from kunlun_runtime.server.app import create_app
from kunlun_runtime.server.lifecycle import Lifecycle
from tests.integration.server.live import free_port, health_status
from tests.support.waiting import wait_for


def serve(app) -> tuple[uvicorn.Server, threading.Thread, str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    return server, thread, f"http://127.0.0.1:{port}"


def test_health_is_503_until_the_model_is_loaded_then_200(tiny_model_dir: Path) -> None:
    release = threading.Event()
    config = EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=16 << 20)

    def slow_factory() -> LLMEngine:
        release.wait(120)
        return LLMEngine(config.validate())

    server, thread, base_url = serve(create_app(slow_factory))
    try:
        wait_for(
            lambda: health_status(base_url) is not None, timeout_seconds=60.0, message="the port to open"
        )
        health = httpx.get(f"{base_url}/health")
        assert health.status_code == 503 and health.headers["Retry-After"]
        models = httpx.get(f"{base_url}/v1/models")
        assert models.status_code == 503 and models.json()["error"]["type"] == "ServiceUnavailableError"
        release.set()
        wait_for(lambda: health_status(base_url) == 200, timeout_seconds=300.0, message="readiness")
        assert httpx.get(f"{base_url}/v1/models").status_code == 200
    finally:
        release.set()
        server.should_exit = True
        thread.join(30)


def test_a_model_that_fails_to_load_never_becomes_ready(tmp_path: Path) -> None:
    failed = threading.Event()

    def broken_factory() -> LLMEngine:
        try:
            raise ModelLoadError(f"{tmp_path}/config.json: missing")
        finally:
            failed.set()

    app = create_app(broken_factory)
    server, thread, base_url = serve(app)
    try:
        wait_for(failed.is_set, timeout_seconds=60.0, message="the load to fail")
        wait_for(
            lambda: app.state.lifecycle.state.value == "failed",
            timeout_seconds=60.0,
            message="the failed state",
        )
        assert health_status(base_url) == 503
        assert "failed" in httpx.get(f"{base_url}/v1/models").json()["error"]["message"]
    finally:
        server.should_exit = True
        thread.join(30)


def test_only_a_serve_only_process_freezes_the_heap_left_by_loading(tiny_model_dir: Path) -> None:
    """``kunlun-runtime serve`` (``freeze_gc_after_load``) exempts the loaded model and libraries
    from cyclic collection before it turns ready; a server embedded in another program does not."""
    config = EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=16 << 20)
    for freeze in (False, True):
        gc.unfreeze()

        def factory() -> LLMEngine:
            return LLMEngine(config.validate())

        lifecycle = Lifecycle(factory, freeze_gc_after_load=freeze)
        server, thread, base_url = serve(create_app(factory, lifecycle=lifecycle))
        try:
            wait_for(
                lambda url=base_url: health_status(url) == 200, timeout_seconds=300.0, message="readiness"
            )
            assert (gc.get_freeze_count() > 0) is freeze
            assert httpx.get(f"{base_url}/v1/models").status_code == 200
        finally:
            server.should_exit = True
            thread.join(30)
            gc.unfreeze()

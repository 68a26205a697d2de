"""A first start that compiles our CPU kernels says so while it lasts: the 503s of /health and of
the API name the tier, that it happens once, where it is cached and how far it got, instead of a
bare "the model is loading"; once ready, /version and kunlun:runtime_info say what the engine runs."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import httpx
import uvicorn

from kunlun_runtime.config import EngineConfig
from kunlun_runtime.engine.llm_engine import LLMEngine
from kunlun_runtime.layers.kernel_build import building
from kunlun_runtime.server.app import create_app
from tests.integration.server.live import free_port, health_status, sample, scrape
from tests.support.waiting import wait_for


def test_the_503s_say_a_kernel_build_is_under_way_and_how_far_it_got(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    build_dir = tmp_path / "kunlun_avx512_abc"
    building_now, release = threading.Event(), threading.Event()
    config = EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=16 << 20)
    built: list[LLMEngine] = []  # the engine the server serves, to compare with what it says

    def compiling_factory() -> LLMEngine:
        # The phase as the kernel loader sets it: one of two sources compiled so far.
        with building("avx512", build_dir, ("small_batch_linear.cpp", "registration.cpp")):
            build_dir.mkdir()
            (build_dir / "small_batch_linear.o").touch()
            building_now.set()
            release.wait(120)
        built.append(LLMEngine(config.validate()))
        return built[0]

    app = create_app(compiling_factory)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_for(building_now.is_set, timeout_seconds=60.0, message="the build phase")
        wait_for(lambda: health_status(base_url) is not None, timeout_seconds=60.0, message="the port")
        phase = (
            re.escape(
                "the model is loading: first building the avx512 CPU kernels for this machine (first "
                f"start only: later starts load the library cached in {build_dir}): 1 of 2 C++ sources "
                "compiled, "
            )
            + r"\d+ s so far"
        )
        health = httpx.get(f"{base_url}/health")
        assert health.status_code == 503 and health.headers["Retry-After"]
        assert re.fullmatch(re.escape("not ready (loading): ") + phase, health.json()["error"]["message"])
        models = httpx.get(f"{base_url}/v1/models")
        assert models.status_code == 503
        assert re.fullmatch(phase, models.json()["error"]["message"])
        assert httpx.get(f"{base_url}/version").json()["runtime"] is None

        release.set()
        wait_for(lambda: health_status(base_url) == 200, timeout_seconds=300.0, message="readiness")
        [engine] = built
        version = httpx.get(f"{base_url}/version").json()
        assert version["runtime"] == engine.runtime_info.describe()
        assert version["runtime"]["dtype"] == "float32"
        labels = engine.runtime_info.labels()
        assert sample(scrape(base_url), "kunlun:runtime_info", **labels) == 1
        assert labels == {
            "backend": version["runtime"]["backend"],
            "tier": version["runtime"]["tier"],
            "dtype": "float32",
            "kv_dtype": version["runtime"]["kv_dtype"],
        }
    finally:
        release.set()
        server.should_exit = True
        thread.join(30)

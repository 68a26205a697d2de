"""``kunlun-runtime serve`` with vLLM's LoRA flags: ``--lora-modules`` adapters are served from the
start (and the run-time routes exist with ``--allow-runtime-lora-updating``); an adapter that
cannot be served fails the start, exit 1, naming it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.integration.server.live import SERVE_MAIN, free_port, start_serve_process
from tests.support.lora_adapters import make_adapter


@pytest.fixture(scope="module")
def sql_adapter(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter(tiny_model_dir, tmp_path_factory.mktemp("cli-adapters") / "sql", rank=8)


def test_serve_serves_its_lora_modules_and_the_runtime_routes(
    tiny_model_dir: Path, sql_adapter: Path
) -> None:
    module = f'{{"name": "sql", "path": "{sql_adapter}", "base_model_name": "{tiny_model_dir.name}"}}'
    process, base_url = start_serve_process(
        tiny_model_dir,
        "--enable-lora",
        "--max-loras",
        "2",
        "--lora-modules",
        module,
        "--allow-runtime-lora-updating",
    )
    try:
        cards = {card["id"]: card for card in httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"]}
        assert (cards["sql"]["parent"], cards["sql"]["root"]) == (tiny_model_dir.name, str(sql_adapter))
        body = {"model": "sql", "prompt": "hi", "max_tokens": 2}
        answer = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
        assert (answer.status_code, answer.json()["model"]) == (200, "sql")
        loaded = httpx.post(
            f"{base_url}/v1/load_lora_adapter",
            json={"lora_name": "sql2", "lora_path": str(sql_adapter)},
            timeout=60,
        )
        assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'sql2' added successfully.")
        metrics = httpx.get(f"{base_url}/metrics", timeout=30).text
        assert 'vllm:lora_requests_info{max_lora="2"' in metrics
    finally:
        process.terminate()
        assert process.wait(timeout=60) == 0


def test_an_adapter_that_cannot_be_served_fails_the_start_naming_it(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    command = [
        sys.executable, "-c", SERVE_MAIN, "serve", "--model", str(tiny_model_dir), "--dtype", "float32",
        "--kv-cache-memory", "16MiB", "--host", "127.0.0.1", "--port", str(free_port()),
        "--enable-lora", "--lora-modules", f"broken={tmp_path / 'missing'}",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    log = done.stdout + done.stderr
    assert done.returncode == 1, log
    assert f"--lora-modules broken={tmp_path / 'missing'}: lora adapter 'broken'" in log
    assert "not found" in log

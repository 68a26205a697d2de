"""Smoke run of benchmarks/bench_serving.py against a live server: it still works end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.integration.server.live import serve_in_thread

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_serving.py"


def test_bench_serving_reports_throughput_and_latency_percentiles(tiny_model_dir: Path) -> None:
    with serve_in_thread(tiny_model_dir, served_model_name="bench-model") as server:
        result = subprocess.run(
            [sys.executable, str(BENCH), "--base-url", server.base_url, "--served-model-name", "bench-model",
             "--num-clients", "3", "--requests-per-client", "2", "--max-tokens", "5", "--json"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    assert result.returncode == 0, result.stderr
    [report] = json.loads(result.stdout)["reports"]
    assert report["num_requests"] == 6 and report["completion_tokens"] == 30
    assert report["errors"] == []
    assert report["output_tokens_per_second"] > 0
    assert 0 < report["ttft_p50_seconds"] <= report["ttft_p99_seconds"]
    assert 0 < report["itl_p50_seconds"] <= report["itl_p99_seconds"]

"""The pipeline benchmark still runs: ``--quick`` on a tiny model prints its row and writes
well-formed results for the three engines (no timing thresholds: timings here are noise)."""

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tests.support.tiny_models import TINY_SPECS, make_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_reports_the_boundary_cost_and_the_micro_batching_gain(tmp_path):
    model_dir = make_tiny_model(tmp_path / "tiny", replace(TINY_SPECS["llama-gqa"], num_layers=4))
    results = tmp_path / "results.json"
    command = [
        sys.executable, str(ROOT / "benchmarks" / "bench_pipeline.py"), "--quick", "--model", str(model_dir),
        "--dtype", "float32", "--json", str(results),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "boundary" in done.stdout and "micro-batching" in done.stdout
    row = json.loads(results.read_text())["batches"]["4"]
    for key in ("one_step_ms", "staged_step_ms", "overlapped_step_ms"):
        assert math.isfinite(row[key]) and row[key] > 0
    assert row["boundary_ms_per_step"] == pytest.approx(row["staged_step_ms"] - row["one_step_ms"])
    assert row["micro_batching_gain"] == pytest.approx(row["staged_step_ms"] / row["overlapped_step_ms"])

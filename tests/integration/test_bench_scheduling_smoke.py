"""The scheduling benchmark still runs: ``--quick`` on a tiny model prints its table and writes
well-formed results for both policies (no timing thresholds: timings here are noise)."""

import json
import math
import subprocess
import sys
from pathlib import Path

from tests.support.tiny_models import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
METRICS = [
    "ttft_p50_s",
    "ttft_p99_s",
    "ttft_chat_p50_s",
    "ttft_doc_p50_s",
    "itl_p50_s",
    "itl_p99_s",
    "throughput_tok_s",
]


def test_quick_run_reports_both_policies_and_their_ratios(tmp_path):
    model_dir = make_tiny_model(tmp_path / "tiny")
    results = tmp_path / "results.json"
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "bench_scheduling.py"),
        "--quick",
        "--model",
        str(model_dir),
        "--dtype",
        "float32",
        "--json",
        str(results),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("mixed workload: 8 requests/rep × 1 reps")
    assert lines[1].split() == ["metric", "fixed", "feedback", "feedback/fixed", "paired", "median"]
    assert [line.split()[0] for line in lines[2:]] == METRICS
    data = json.loads(results.read_text())
    assert data["reps"] == 1
    assert data["shape"]["num_requests"] == 8
    for policy in ("fixed", "feedback"):
        assert sorted(data[policy]) == sorted(METRICS)
        assert all(value > 0 and math.isfinite(value) for value in data[policy].values())
    for key in METRICS:
        assert data["ratio"][key] == data["feedback"][key] / data["fixed"][key]
        assert data["paired_ratio"][key] == data["ratio"][key]  # one repetition: the pair is the whole run

"""The speculative-decoding benchmark still runs: ``--quick`` on a tiny model measures both
workloads at batch 1, 8 and 8 in flight, plain and with each drafting method, and reports every
ratio, its target (none for the closed batch of 8 copying) and the acceptance (no timing thresholds:
timings here are noise)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.tiny_models import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_reports_every_ratio_and_the_acceptance(tmp_path):
    model_dir = make_tiny_model(tmp_path / "tiny")
    results = tmp_path / "results.json"
    command = [
        sys.executable, str(ROOT / "benchmarks" / "bench_speculative.py"), "--quick", "--model", str(model_dir),
        "--dtype", "float32", "--json", str(results),
    ]  # fmt: skip
    # a developer's llama.cpp (LLAMA_LOOKUP) is not part of this check
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_LOOKUP"}
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=600, check=False, cwd=ROOT, env=env
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(results.read_text())
    for method in ("ngram", "suffix"):
        assert report[method]["speculative_config"]["method"] == method
        assert 0.0 <= report[method]["acceptance_rate"] <= 1.0
        for workload in ("copy", "free"):
            for batch, key in ((1, "batch1"), (8, "batch8"), ("8 in flight", "batch8_in_flight")):
                side = report[method][f"{workload}_{key}"]
                assert side["plain_tok_s"] > 0 and side["spec_tok_s"] > 0
                assert side["ratio"] == pytest.approx(side["spec_tok_s"] / side["plain_tok_s"], rel=0.02)
                # The plain engine decodes a token a step; drafts can only add to a step's tokens,
                # and the ratio splits into what they added and what the steps cost.
                assert side["plain_tokens_per_step"] == 1.0 and side["tokens_per_step"] >= 1.0
                assert side["ratio"] == pytest.approx(
                    side["tokens_per_step"] * side["step_rate_ratio"], rel=0.01
                )
                if key == "batch8" and workload == "copy":
                    assert side["target"] is None and side["met"]
                else:
                    assert side["met"] == (side["ratio"] >= side["target"])
                # A closed batch of 8: its requests' rate carries the target, the batch's beside it.
                assert ("batch_ratio" in side) == (key == "batch8")
                assert (
                    f"{method} {workload} batch {batch}: plain {side['plain_tok_s']:.1f} tok/s" in done.stdout
                )

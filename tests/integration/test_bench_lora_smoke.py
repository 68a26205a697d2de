"""The LoRA benchmark still runs: ``--quick`` on a tiny model runs both sides at batch 8 and 1 and
the adapter load, and reports each number (no timing thresholds: timings here are noise)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.tiny_models import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_reports_both_sides_the_ratios_and_the_load(tmp_path):
    model_dir = make_tiny_model(tmp_path / "tiny")
    results = tmp_path / "results.json"
    command = [
        sys.executable, str(ROOT / "benchmarks" / "bench_lora.py"), "--quick", "--model", str(model_dir),
        "--dtype", "float32", "--json", str(results),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    report = json.loads(results.read_text())
    assert report["adapters"] == 4 and report["rank"] == 16
    for batch in ("batch8", "batch1"):
        side = report[batch]
        assert side["base_decode_tok_s"] > 0 and side["lora_decode_tok_s"] > 0
        assert side["decode_ratio"] == pytest.approx(
            side["lora_decode_tok_s"] / side["base_decode_tok_s"], rel=0.02
        )
        assert side["target"] in (0.8, 0.85) and side["met"] == (side["decode_ratio"] >= side["target"])
    load = report["load_rank64"]
    assert load["rank"] == 64 and load["bytes"] > 0 and load["read_s"] > 0
    assert f"batch 8: decode base {report['batch8']['base_decode_tok_s']:.1f} tok/s" in done.stdout

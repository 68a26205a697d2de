"""The KV cache dtype benchmark still runs: ``--quick`` on a tiny model, in its own process (it sets
the ISA tier before the runtime loads), prints the ratios and writes well-formed results for both
caches (no timing thresholds: timings here are noise)."""

import json
import math
import subprocess
import sys
from pathlib import Path

from kunlun_runtime.platforms.cpu_features import IsaTier, cpu_capabilities
from tests.support.tiny_models import TINY_SPECS, make_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_compares_bf16_and_fp32_kv_side_by_side(tmp_path):
    model_dir = make_tiny_model(tmp_path / "tiny", TINY_SPECS["llama-gqa"])
    results = tmp_path / "results.json"
    isa = "avx2" if cpu_capabilities().detected_tier >= IsaTier.AVX2 else "none"
    command = [
        sys.executable, str(ROOT / "benchmarks" / "bench_kv_dtype.py"), "--quick", "--model", str(model_dir),
        "--isa", isa, "--json", str(results),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "BF16/FP32" in done.stdout and "tokens held per GiB" in done.stdout
    report = json.loads(results.read_text())
    assert (report["isa_tier"], report["activation_dtype"]) == (isa, "float32")
    assert report["kv_cache_dtypes"] == {"float32": "float32", "bfloat16": "bfloat16"}
    assert set(report["decode"]) == {"40x1", "40x2", "100x1", "100x2"}
    for row in report["decode"].values():
        assert math.isfinite(row["float32_tok_s"]) and row["float32_tok_s"] > 0
        assert math.isfinite(row["bfloat16_tok_s"]) and row["bfloat16_tok_s"] > 0
        assert row["bf16_vs_fp32"] == row["bfloat16_tok_s"] / row["float32_tok_s"]
    held = report["tokens_per_gib"]
    assert held["bfloat16"] > held["float32"] > 0
    assert report["tokens_per_gib_ratio"] == held["bfloat16"] / held["float32"]

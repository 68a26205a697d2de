"""The routing benchmark still runs: ``--quick`` on a tiny model replays its workload in every mode
(round-robin, the approximate and the precise picker, the single replica) and reports each in full
(no timing thresholds: timings here are noise)."""

import json
import math
import subprocess
import sys
from pathlib import Path

from tests.support.tiny_models import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
MODES = ["round_robin", "prefix_aware", "precise", "single"]
NUM_TURNS = 3 * 2  # --quick: 3 conversations × 2 turns


def test_quick_run_completes_every_turn_in_every_mode_and_reports_the_ratios(tmp_path):
    model_dir = make_tiny_model(tmp_path / "tiny")
    results = tmp_path / "results.json"
    command = [
        sys.executable, str(ROOT / "benchmarks" / "bench_routing.py"), "--quick", "--model", str(model_dir),
        "--dtype", "float32", "--json", str(results),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == [
        "mode",
        "replicas",
        "done",
        "TTFT",
        "p50",
        "TTFT",
        "p90",
        "hit",
        "rate",
        "out",
        "tok/s",
    ]
    assert [line.split()[0] for line in lines[1:5]] == MODES
    report = json.loads(results.read_text())
    assert list(report["modes"]) == MODES
    for mode, row in report["modes"].items():
        assert row["errors"] == [], mode
        assert row["num_completed"] == row["num_requests"] == NUM_TURNS, mode
        assert row["num_replicas"] == (1 if mode == "single" else 3)
        assert sum(row["requests_per_replica"]) == NUM_TURNS
        assert row["output_tokens"] == NUM_TURNS * 4  # --quick answers 4 tokens, ignore_eos
        # The fleet's counters cover exactly this mode's turns: every prompt token was looked up once.
        assert row["prefix_query_tokens"] == row["prompt_tokens"] > 0
        assert 0 <= row["prefix_hit_tokens"] <= row["prefix_query_tokens"]
        assert row["prefix_hit_rate"] == row["prefix_hit_tokens"] / row["prefix_query_tokens"]
        for key in ("ttft_p50_s", "ttft_p90_s", "output_tokens_per_s", "makespan_s"):
            assert row[key] > 0 and math.isfinite(row[key]), (mode, key)
    for mode in ("prefix_aware", "precise"):
        picker = report["modes"][mode]["picker"]
        assert picker["picks"] == NUM_TURNS
        # A second turn extends its first: the picker finds it, from its own picks or from the
        # replicas' KV events (hashes it recomputed from the tokens, equal to the engine's).
        assert 0 < picker["matched_block_fraction"] <= 1
        ratios = report["ratios"][mode]
        rr, single = report["modes"]["round_robin"], report["modes"]["single"]
        assert ratios["ttft_p50_vs_round_robin"] == report["modes"][mode]["ttft_p50_s"] / rr["ttft_p50_s"]
        assert (
            ratios["hit_rate_vs_single"]
            == report["modes"][mode]["prefix_hit_rate"] / single["prefix_hit_rate"]
        )
    assert sum(report["modes"]["precise"]["picker"]["event_batches"]) > 0

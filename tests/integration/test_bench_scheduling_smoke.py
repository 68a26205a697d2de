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
    "cached_prompt_fraction",
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
        timings = {key: value for key, value in data[policy].items() if key != "cached_prompt_fraction"}
        assert all(value > 0 and math.isfinite(value) for value in timings.values())
        assert 0.0 <= data[policy]["cached_prompt_fraction"] <= 1.0
        (run,) = data["runs"][policy]  # the raw numbers behind the table, for a tail's post-mortem
        assert run["makespan_s"] > 0 and len(run["ttft_s"]) == 8
        assert max(run["ttft_s"].values()) <= run["makespan_s"]
    for key in METRICS:
        if data["fixed"][key] == 0:  # cached_prompt_fraction without a cache hit
            assert math.isnan(data["ratio"][key]) and math.isnan(data["paired_ratio"][key])
            continue
        assert data["ratio"][key] == data["feedback"][key] / data["fixed"][key]
        assert data["paired_ratio"][key] == data["ratio"][key]  # one repetition: the pair is the whole run


def test_docqa_follow_ups_extend_their_document_and_arrive_after_it():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from bench_scheduling import DOCQA, build_workload
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    jobs = build_workload(DOCQA, seed=3, vocab_size=1000)
    by_id = {job.request_id: job for job in jobs}
    followups = [job for job in jobs if job.kind == "followup"]
    assert followups and [job.arrival_seconds for job in jobs] == sorted(job.arrival_seconds for job in jobs)
    for job in followups:
        document = by_id["doc-" + job.request_id.split("-")[1]]
        assert job.arrival_seconds > document.arrival_seconds
        assert job.prompt_token_ids[: len(document.prompt_token_ids)] == document.prompt_token_ids
        assert len(job.prompt_token_ids) > len(document.prompt_token_ids)
    documents = [job for job in jobs if job.kind == "doc"]
    assert len(followups) >= len(documents)  # one or two per document

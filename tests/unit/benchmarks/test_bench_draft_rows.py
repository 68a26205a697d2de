"""benchmarks/bench_draft_rows.py on a small setting: it times ours and the baseline for every row
count and writes them."""

import json

import torch

from tests.support.benchmark_scripts import load_benchmark
from tests.support.kernel_marks import needs_kernels


@needs_kernels(torch.bfloat16)
def test_it_times_both_sides_for_every_row_count(tmp_path, capsys):
    bench = load_benchmark("bench_draft_rows")
    out = tmp_path / "rows.json"
    argv = ["--rows", "1,9", "--context", "40", "--repeats", "1", "--layers", "1", "--json", str(out)]
    assert bench.main(argv) == 0
    ms = json.loads(out.read_text())["ms"]
    for rows in (1, 9):
        for name in ("linears", "linears_passes_of_8", "attention", "attention_separate"):
            assert ms[f"{name}/{rows}"] > 0
    assert "passes of 8" in capsys.readouterr().out

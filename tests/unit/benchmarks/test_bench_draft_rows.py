"""benchmarks/bench_draft_rows.py on a small setting: it times ours and the baseline for every row
count and writes them."""

import json

import pytest
import torch

from kunlun_runtime.layers import cpu_kernels
from tests.support.benchmark_scripts import load_benchmark

needs_kernels = pytest.mark.skipif(
    not cpu_kernels.load(torch.bfloat16), reason=str(cpu_kernels.unavailable_reason(torch.bfloat16))
)


@needs_kernels
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

"""benchmarks/bench_kernel_ab.py on a tiny model: the last commit's kernels are built beside this
tree's and both are timed in every case, with their outputs compared bit for bit."""

import json

import pytest
import torch

from kunlun_runtime.layers import cpu_kernels
from tests.support.benchmark_scripts import BENCHMARKS, load_benchmark
from tests.support.tiny_models import make_tiny_model

needs_kernels = pytest.mark.skipif(
    not cpu_kernels.load(torch.bfloat16), reason=str(cpu_kernels.unavailable_reason(torch.bfloat16))
)


@needs_kernels
def test_the_base_commit_is_built_and_both_sides_are_timed_in_every_case(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # it imports bench_engine, beside it
    bench = load_benchmark("bench_kernel_ab")
    model = make_tiny_model(tmp_path / "tiny")
    out = tmp_path / "ab.json"
    argv = ["--base", "HEAD", "--model", str(model), "--rows", "1", "9", "--reps", "2", "--calls", "2"]
    assert bench.main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert len(report["base"]) == 40  # the commit it resolved HEAD to
    assert len(report["cached"]) == 5 * 2  # four projections and the LM head, at 1 and 9 rows
    assert set(report["step"]) == {"x1", "x9"}
    for row in [*report["cached"].values(), *report["step"].values()]:
        assert row["ratio"] == pytest.approx(row["ms"]["base"] / row["ms"]["tree"])
        assert min(row["gflops"].values()) > 0
        # HEAD's kernels against this tree's: the same sources unless the tree has uncommitted
        # kernel changes, and bit-identical outputs either way (no kernel change may alter them
        # without a test that says so).
        assert row["differing_outputs"] == 0


@needs_kernels
def test_an_unknown_base_is_an_error_not_a_silent_comparison(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = load_benchmark("bench_kernel_ab")
    with pytest.raises(ValueError, match="'no-such-revision' is not a commit"):
        bench.build_base("no-such-revision")
    assert bench.main(["--base", "no-such-revision"]) == 2
    assert "'no-such-revision' is not a commit" in capsys.readouterr().err

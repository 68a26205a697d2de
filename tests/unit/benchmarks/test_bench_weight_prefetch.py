"""benchmarks/bench_weight_prefetch.py on a tiny model: both prefetch orders are timed in every
case, on the linears and in the engine, and the order in force before is in force after."""

import json

import pytest
import torch

from tests.support.benchmark_scripts import BENCHMARKS, load_benchmark
from tests.support.kernel_marks import needs_kernels
from tests.support.tiny_models import make_tiny_model


@needs_kernels(torch.bfloat16)
def test_both_orders_are_timed_in_every_case_and_the_default_is_kept(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # it imports bench_engine, beside it
    bench = load_benchmark("bench_weight_prefetch")
    model = make_tiny_model(tmp_path / "tiny")
    out = tmp_path / "prefetch.json"
    before = torch.ops.kunlun_avx512.weight_prefetch()
    argv = ["--model", str(model), "--reps", "2", "--engine-reps", "2", "--prompt", "16", "--new", "6"]
    assert bench.main([*argv, "--bandwidth-mb", "16", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["default_policy"] == before == torch.ops.kunlun_avx512.weight_prefetch()
    assert set(report["linears"]) == {"bf16 x1", "bf16 x2", "bf16 x8", "int8 x1"}
    for row in report["linears"].values():
        assert row["ratio"] == pytest.approx(row["ms"]["rows-l2"] / row["ms"]["stream-l1"])
        assert all(value > 0 for value in row["gb_s"].values())
    assert set(report["engine"]) == {"bf16", "int8"}
    for row in report["engine"].values():
        assert all(len(samples) == 2 and min(samples) > 0 for samples in row["samples"].values())
        assert row["ratio"] == pytest.approx(row["tok_s"]["stream-l1"] / row["tok_s"]["rows-l2"])

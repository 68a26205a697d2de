"""benchmarks/bench_decode_batches.py: both engines decode every batch, and the baseline's steps of
more than 16 rows really leave our one-call layer stack (while ours keep it)."""

import json

import pytest
import torch

from kunlun_runtime.layers import cpu_kernels
from tests.support.benchmark_scripts import BENCHMARKS, load_benchmark
from tests.support.kernel_marks import needs_kernels
from tests.support.tiny_models import make_tiny_model


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # it imports bench_speculative and engine_batches
    return load_benchmark("bench_decode_batches")


@needs_kernels(torch.bfloat16)
def test_both_engines_decode_each_batch_and_only_ours_keeps_wide_steps_on_the_layer_stack(
    bench, tmp_path, monkeypatch
):
    steps = []
    real = cpu_kernels.decode_layers
    monkeypatch.setattr(cpu_kernels, "decode_layers", lambda x, *a: steps.append(x.shape[0]) or real(x, *a))
    out = tmp_path / "batches.json"
    model = make_tiny_model(tmp_path / "tiny")
    argv = ["--quick", "--model", str(model), "--batches", "4,20", "--repeats", "2", "--json", str(out)]
    assert bench.main(argv) == 0
    report = json.loads(out.read_text())
    for batch in ("4", "20"):
        assert report[batch]["ours"] > 0 and report[batch]["limited"] > 0
        assert report[batch]["ratio"] > 0
    # Per repetition and engine, 3 decode steps of each batch (4 tokens: 1 from prefill); the
    # baseline's 20-row steps go layer by layer, so one call of 20 rows per step is ours alone.
    assert steps.count(20) == 2 * 3 and steps.count(4) == 2 * 2 * 3

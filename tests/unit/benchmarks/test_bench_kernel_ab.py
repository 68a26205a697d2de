"""benchmarks/bench_kernel_ab.py on a tiny model: the last commit's kernels are built beside this
tree's and both are timed in every case, with their outputs compared bit for bit, and in the
engine the two libraries take turns step by step."""

import json

import pytest
import torch

from kunlun_runtime.platforms.cpu_features import IsaTier, cpu_capabilities
from tests.support.benchmark_scripts import BENCHMARKS, load_benchmark
from tests.support.kernel_marks import needs_kernels
from tests.support.tiny_models import make_tiny_model

# The benchmark compares the kernels of the tier in force here: the AVX2 tier's compute in FP32.
IN_FORCE = torch.float32 if cpu_capabilities().tier is IsaTier.AVX2 else torch.bfloat16


@needs_kernels(IN_FORCE)
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


@needs_kernels(IN_FORCE)
def test_an_unknown_base_is_an_error_not_a_silent_comparison(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = load_benchmark("bench_kernel_ab")
    with pytest.raises(ValueError, match="'no-such-revision' is not a commit"):
        bench.build_base("no-such-revision", bench.cpu_kernels.TIERS[bench.IsaTier.AVX512])
    assert bench.main(["--base", "no-such-revision"]) == 2
    assert "'no-such-revision' is not a commit" in capsys.readouterr().err


def _report(tmp_path, monkeypatch, *cases: str) -> dict:
    """The JSON report of HEAD's kernels against this tree's on a tiny model, one row, with ``cases``."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = load_benchmark("bench_kernel_ab")
    model = make_tiny_model(tmp_path / "tiny")
    out = tmp_path / "ab.json"
    argv = ["--base", "HEAD", "--model", str(model), "--rows", "1", "--reps", "2", "--calls", "1"]
    assert bench.main([*argv, *cases, "--json", str(out)]) == 0
    assert bench.cpu_kernels._ops.__name__ == "_ops"  # the engine's dispatch is restored
    return json.loads(out.read_text())


@needs_kernels(IN_FORCE)
def test_the_engine_cases_swap_the_libraries_every_decode_step(tmp_path, monkeypatch):
    cases = ["--engine", "24x1", "16x3", "--engine-tokens", "6", "--engine-reps", "2"]
    engine = _report(tmp_path, monkeypatch, *cases)["engine"]
    assert set(engine) == {"24x1", "16x3"}
    for row in engine.values():
        # Each batch decodes 5 steps after its prefill (6 tokens, the first from the prefill),
        # split between the libraries in turn: 2 batches, 10 decode steps, 5 each.
        assert row["steps"] == {"base": 5, "tree": 5}
        assert row["ratio"] == pytest.approx(row["ms_per_step"]["base"] / row["ms_per_step"]["tree"])


@needs_kernels(IN_FORCE)
def test_the_attention_cases_time_both_sides_over_every_layers_cache(tmp_path, monkeypatch):
    attention = _report(tmp_path, monkeypatch, "--attention", "40x1", "24x3x2")["attention"]
    assert set(attention) == {"40x1x1", "24x3x2"}
    for row in attention.values():
        assert row["ratio"] == pytest.approx(row["ms"]["base"] / row["ms"]["tree"])
        assert min(row["gflops"].values()) > 0
        assert row["differing_outputs"] == 0  # the same sources: the same bits


def test_an_attention_case_is_context_x_rows_and_sequences(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = load_benchmark("bench_kernel_ab")
    assert bench.parse_args(["--attention", "1500x6", "1500x2x8"]).attention == [(1500, 6, 1), (1500, 2, 8)]
    for bad in ("1500", "0x1", "1500x", "1500x2x0", "1x2x3x4", "ax1"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--attention", bad])


def test_an_engine_case_is_context_x_batch(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = load_benchmark("bench_kernel_ab")
    assert bench.parse_args(["--engine", "256x1", "1024x8"]).engine == [(256, 1), (1024, 8)]
    for bad in ("256", "0x1", "256x", "ax1"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--engine", bad])


def test_a_base_builds_from_the_sources_its_commit_has(tmp_path, monkeypatch):
    """A commit from before a tier's source was split or added has fewer files than this tree's
    tier lists: the base is its tier folders' .cpp files as they were, and the shared sources."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = load_benchmark("bench_kernel_ab")
    tier = bench.cpu_kernels.TIERS[bench.IsaTier.AVX2]
    csrc = tmp_path / "csrc"
    (csrc / "avx2").mkdir(parents=True)
    older = [
        "avx2/argmax.cpp",
        "avx2/decode_ops.cpp",
        "avx2/linear.cpp",
        "decode_layers.cpp",
        "registration.cpp",
    ]
    for name in [*older, "avx2/vec_avx2.h", "kernels.h"]:
        (csrc / name).touch()
    assert bench._sources_at(csrc, tier) == [csrc / name for name in older]
    (csrc / "avx2" / "decode_attention.cpp").touch()
    assert csrc / "avx2" / "decode_attention.cpp" in bench._sources_at(csrc, tier)
    # This tree's own csrc gives exactly the tier's sources.
    here = bench._sources_at(bench.cpu_kernels.CSRC, tier)
    assert sorted(here) == sorted(tier.sources)


@needs_kernels(IN_FORCE)
def test_int8_weights_time_linear_int8_on_both_sides(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = load_benchmark("bench_kernel_ab")
    model = make_tiny_model(tmp_path / "tiny")
    out = tmp_path / "ab.json"
    argv = ["--base", "HEAD", "--model", str(model), "--rows", "1", "6", "--reps", "2", "--calls", "2"]
    assert bench.main([*argv, "--weights", "int8", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert len(report["cached"]) == 5 * 2 and set(report["step"]) == {"x1", "x6"}
    for row in [*report["cached"].values(), *report["step"].values()]:
        assert min(row["gflops"].values()) > 0
        assert row["differing_outputs"] == 0
    assert report["weights"] == "int8"  # recorded beside the numbers

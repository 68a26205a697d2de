"""benchmarks/bench_decode_vs_llama.py: each format's engine decodes every repetition beside
llama-bench run on that format's GGUF with the same shape, and the ratio is of the medians.
llama.cpp is not built in the test suite: a script in llama-bench's place records its command line
and answers in llama-bench's JSON format (one row per flash-attention setting)."""

import json
import statistics
import sys
from pathlib import Path

import pytest

from tests.support.benchmark_scripts import BENCHMARKS, load_benchmark
from tests.support.tiny_models import make_tiny_model


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # it imports bench_engine, beside it
    return load_benchmark("bench_decode_vs_llama")


def fake_llama_dir(tmp_path: Path) -> Path:
    llama = tmp_path / "llama"
    (llama / "build" / "bin").mkdir(parents=True)
    for gguf in ("smollm2-BF16.gguf", "smollm2-Q8_0.gguf"):
        (llama / gguf).write_bytes(b"GGUF")
    binary = llama / "build" / "bin" / "llama-bench"
    calls = llama / "calls.jsonl"
    binary.write_text(
        f"#!{sys.executable}\n"
        "import json, sys\n"
        f"open({str(calls)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
        "rate = 50.0 if 'BF16' in sys.argv[sys.argv.index('-m') + 1] else 80.0\n"
        "print(json.dumps([{'avg_ts': rate}, {'avg_ts': rate / 2}]))\n"
    )
    binary.chmod(0o755)
    return llama


def test_each_format_runs_beside_llama_bench_on_its_own_gguf(bench, tmp_path):
    model = make_tiny_model(tmp_path / "tiny")
    llama = fake_llama_dir(tmp_path)
    out = tmp_path / "result.json"
    argv = ["--llama-dir", str(llama), "--model", str(model), "--reps", "2", "--prompt", "24", "--new", "6"]
    assert bench.main([*argv, "--bandwidth-mb", "16", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["formats"]) == {"bf16", "int8"}
    for name, expected in (("bf16", 50.0), ("int8", 80.0)):
        row = report["formats"][name]
        assert row["llama_cpp_tok_s"] == expected  # the faster flash-attention setting counts
        assert len(row["samples"]["ours"]) == 2 and all(rate > 0 for rate in row["samples"]["ours"])
        assert row["ratio"] == pytest.approx(statistics.median(row["samples"]["ours"]) / expected)
    calls = [json.loads(line) for line in (llama / "calls.jsonl").read_text().splitlines()]
    ggufs = [Path(call[call.index("-m") + 1]).name for call in calls]
    assert ggufs == ["smollm2-BF16.gguf", "smollm2-Q8_0.gguf"] * 2  # interleaved, per repetition
    for call in calls:  # the engine's shape: 6 tokens after a 24-token context, 2 threads
        assert call[call.index("-d") + 1] == "24" and call[call.index("-n") + 1] == "6"
        assert call[call.index("-t") + 1] == "2" and call[call.index("-fa") + 1] == "0,1"


def test_ours_counts_the_best_of_as_many_runs_as_llama_benchs_sample(bench):
    # llama-bench's sample is the better of its two runs (flash attention off and on): ours is the
    # best of as many, each run's rate its decode tokens over the time after the first token.
    timings = iter([(0.5, 1.5), (0.5, 1.0), (0.5, 2.5)])  # (TTFT, total) seconds per run
    calls = []

    def run(prompts, new_tokens):
        calls.append((len(prompts), new_tokens))
        return next(timings)

    assert bench.best_decode_rate(run, [[1, 2]], 11) == pytest.approx(10 / 0.5)
    assert calls == [(1, 11), (1, 11)]  # two runs, the third timing never taken
    assert bench.best_decode_rate(run, [[1], [2]], 11, runs=1) == pytest.approx(2 * 10 / 2.0)


def test_a_run_already_made_counts_as_one_of_the_best_of(bench):
    # bench_engine's INT8 repetitions report their first run on its own and count it among the
    # best of: one more run is made, not two, and the better of the two is the sample.
    timings = iter([(0.5, 2.5), (0.5, 1.5)])
    runs = []

    def run(prompts, new_tokens):
        runs.append(new_tokens)
        return next(timings)

    assert bench.best_decode_rate(run, [[1]], 11, first=3.0) == pytest.approx(10 / 2.0)
    assert runs == [11]
    assert bench.best_decode_rate(run, [[1]], 11, first=30.0) == pytest.approx(30.0)


def test_a_missing_build_is_named(bench, tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--llama-dir", str(tmp_path / "nowhere")])
    assert "build_llama_cpp.sh" in capsys.readouterr().err

"""The grammar-engine benchmark still runs on llguidance alone (the only engine CI installs): a
quick run on a tiny byte-level tokenizer walks every case to its end with every token accepted and
writes well-formed results; an engine that cannot be imported is skipped with its reason. No
timing thresholds: timings here are noise."""

import json
import sys
from pathlib import Path

from tests.support.benchmark_scripts import load_benchmark
from tests.support.tiny_models import build_tokenizer

TIMINGS = ("p50_us", "p99_us", "mean_us", "worst_position_p50_us")


def make_tokenizer_dir(directory: Path) -> Path:
    directory.mkdir(parents=True)
    build_tokenizer().save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return directory


def test_quick_llguidance_run_accepts_every_token_of_every_case(tmp_path, capsys):
    bench = load_benchmark("bench_grammar_engines")
    results_path = tmp_path / "grammar.json"
    argv = ["--engines", "llguidance", "--quick", "--model", str(make_tokenizer_dir(tmp_path / "tok"))]
    assert bench.main([*argv, "--json", str(results_path)]) == 0
    results = json.loads(results_path.read_text())
    assert results["reps"] == 1 and results["batch"] == 8 and results["vocab_size"] == 264
    engine = results["engines"]["llguidance"]
    assert list(results["engines"]) == ["llguidance"]
    assert engine["requires_dist"] == [] and engine["setup_s"] > 0 and engine["cpu_note"]
    assert list(results["cases"]) == [case.name for case in bench.CASES]
    for name, case in results["cases"].items():
        entry = case["engines"]["llguidance"]
        assert case["tokens"] > 0, name
        assert entry["accepts_all"] is True, (name, entry.get("rejected"))
        assert entry["compile_ms"] > 0 and entry["cached_to_first_mask_ms"] > 0 and entry["first_walk_ms"] > 0
        for walk in ("b1", "b8_par", "b8_ser"):
            assert all(entry[f"{walk}_fill"][key] > 0 for key in TIMINGS), (name, walk)
            assert entry[f"{walk}_fill"]["samples"] == case["tokens"] + 1  # a mask per token, then at the end
            assert entry[f"{walk}_advance"]["samples"] == case["tokens"]
        assert "agreement" not in case  # one engine: nothing to compare
    assert "llguidance" in capsys.readouterr().out


def test_an_engine_that_cannot_be_imported_is_skipped_with_its_reason(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "outlines_core", None)  # makes `import outlines_core` fail
    bench = load_benchmark("bench_grammar_engines")
    results_path = tmp_path / "grammar.json"
    argv = ["--engines", "llguidance,outlines-core", "--cases", "choice", "--quick"]
    argv += ["--model", str(make_tokenizer_dir(tmp_path / "tok")), "--json", str(results_path)]
    assert bench.main(argv) == 0
    results = json.loads(results_path.read_text())
    assert results["engines"]["outlines-core"]["skipped"].startswith("cannot import: ")
    assert list(results["cases"]["choice"]["engines"]) == ["llguidance"]
    assert "skipping outlines-core: cannot import" in capsys.readouterr().out

"""The engine benchmarks still run and produce well-formed results (no timing thresholds)."""

import json

import pytest

from kunlun_runtime.platforms.cpu import CpuPlatform
from tests.support.benchmark_scripts import load_benchmark
from tests.support.tiny_models import TINY_SPECS, make_tiny_model


def test_bench_engine_quick_run_writes_results_and_chart(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("LLAMA_BENCH", raising=False)  # a developer's llama.cpp is not part of this check
    model_dir = make_tiny_model(tmp_path / "tiny", TINY_SPECS["llama-gqa"])
    out = tmp_path / "out"
    assert (
        load_benchmark("bench_engine").main(
            ["--quick", "--model", str(model_dir), "--reps", "1", "--out", str(out)]
        )
        == 0
    )
    results = json.loads((out / "results.json").read_text())
    assert set(results["scenarios"]) == {
        "single_256_128",
        "batch8_128_128",
        "long_2048_ttft",
        "int8_single",
        "second_turn_reuse",
    }
    single = results["scenarios"]["single_256_128"]
    assert single["ours_decode_tok_s"] > 0 and single["hf_decode_tok_s"] > 0
    assert single["decode_speedup"] == single["ours_decode_tok_s"] / single["hf_decode_tok_s"]
    long_prompt = results["scenarios"]["long_2048_ttft"]
    assert "ours_decode_tok_s" not in long_prompt and long_prompt["ttft_ratio"] > 0  # a TTFT-only row
    assert set(results["ablation"]) == set(load_benchmark("bench_engine").ablations())  # those the tier runs
    assert {"all on", "no native norm/attention/layer-stack kernels", "no cache-set skew"} <= set(
        results["ablation"]
    )
    assert results["ablation"]["all on"]["vs_all_on"] == 1.0
    batch = results["scenarios"]["batch8_128_128"]
    assert batch["roofline_fraction"] == batch["ours_decode_tok_s"] / batch["roofline_tok_s"]
    assert batch["roofline_vs_hf"] == batch["roofline_tok_s"] / batch["hf_decode_tok_s"]
    for name in ("single_256_128", "long_2048_ttft"):
        row = results["scenarios"][name]
        assert row["onednn_linears_s"] > 0 and row["sdpa_attention_s"] > 0
        assert row["kernels_floor_s"] == row["onednn_linears_s"] + row["sdpa_attention_s"]
        assert row["kernels_floor_vs_hf_ttft"] == row["kernels_floor_s"] / row["hf_ttft_s"]
    assert "onednn_linears_s" not in batch  # eight prompts: no single-prompt floor
    assert (out / "engine.png").stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "ablation" in printed and "TTFT floor" in printed and "batch decode roofline" in printed


def test_prefill_flops_match_a_flop_count_of_the_hf_forward(tmp_path):
    """The TTFT floor's FLOPs are what HF's own forward performs (counted by torch), with attention
    over the causal triangle instead of the full square eager attention multiplies."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    from kunlun_runtime.models.model_config import load_model_config

    model_dir = make_tiny_model(tmp_path / "tiny", TINY_SPECS["llama-gqa"])
    config = load_model_config(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    tokens = 24
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        hf(torch.arange(tokens)[None], logits_to_keep=1)
    square = 4 * config.num_layers * config.q_size * tokens * tokens  # QKᵀ and ·V, every pair
    triangle = 4 * config.num_layers * config.q_size * tokens * (tokens + 1) / 2
    assert (
        load_benchmark("bench_engine").prefill_flops(config, tokens)
        == counter.get_total_flops() - square + triangle
    )


def test_kv_bytes_per_token_is_what_the_cache_keeps_per_token(tmp_path):
    from kunlun_runtime import LLM

    model_dir = make_tiny_model(tmp_path / "tiny", TINY_SPECS["llama-gqa"])
    engine = LLM(str(model_dir), dtype="bfloat16", kv_cache_memory="8MiB", kv_block_skew=False).engine
    per_token = engine.kv_cache.nbytes / (engine.kv_cache.num_blocks * engine.config.block_size)
    bench = load_benchmark("bench_engine")
    assert bench.kv_bytes_per_token(engine.model_config) == per_token
    weights = bench.weight_bytes_per_token(engine.model_config, None)
    assert bench.decode_roofline_tok_s(20.0, weights, 0, 8, 100) == 8 * 20e9 / weights
    assert bench.decode_roofline_tok_s(20.0, weights, per_token, 8, 100) == 8 * 20e9 / (
        weights + 800 * per_token
    )


def test_llama_cpp_comparison_says_which_gguf_it_needs(tmp_path, monkeypatch):
    bench = load_benchmark("bench_engine")
    monkeypatch.delenv("LLAMA_BENCH", raising=False)
    assert bench.llama_bench_from_env() is None  # not asked for: the INT8 row has no llama.cpp column
    monkeypatch.setenv("LLAMA_BENCH", str(tmp_path / "llama-bench"))
    monkeypatch.setenv("LLAMA_BENCH_GGUF", str(tmp_path / "missing.gguf"))
    with pytest.raises(SystemExit, match=r"LLAMA_BENCH_GGUF .* is not a file.*Q8_0"):
        bench.llama_bench_from_env()
    gguf = tmp_path / "model-q8_0.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv("LLAMA_BENCH_GGUF", str(gguf))
    assert bench.llama_bench_from_env() == (str(tmp_path / "llama-bench"), str(gguf))


def test_bench_kv_layout_quick_run(tmp_path):
    out = tmp_path / "kv.json"
    assert load_benchmark("bench_kv_layout").main(["--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    line = CpuPlatform().cache_line_bytes
    assert result["stride_bytes"]["aligned+skewed"] == result["stride_bytes"]["aligned only"] + line
    assert result["skewed_speedup"] > 0


def test_bench_int8_quality_quick_run(tmp_path, capsys):
    model_dir = make_tiny_model(tmp_path / "tiny", TINY_SPECS["qwen2-bias"])
    out = tmp_path / "int8.json"
    args = ["--model", str(model_dir), "--text-tokens", "48", "--prompts", "2", "--new-tokens", "6"]
    assert load_benchmark("bench_int8_quality").main([*args, "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["text_tokens"] == 48 and results["bf16_perplexity"] > 1
    row = results["variants"]["int8 (on the fly)"]
    assert 0 <= row["positional_agreement"] <= 1 and 0 <= row["teacher_forced_agreement"] <= 1
    assert row["perplexity"] > 1
    assert "teacher-forced" in capsys.readouterr().out


def test_bench_overlap_quick_run(tmp_path, capsys):
    model_dir = make_tiny_model(tmp_path / "tiny", TINY_SPECS["llama-gqa"])
    out = tmp_path / "overlap.json"
    argv = [
        "--quick",
        "--model",
        str(model_dir),
        "--dtype",
        "float32",
        "--batch",
        "1",
        "3",
        "--json",
        str(out),
    ]
    assert load_benchmark("bench_overlap").main(argv) == 0
    results = json.loads(out.read_text())
    for name in ("batch1", "batch3"):
        row = results[name]
        assert row["sequential_ms_per_step"] > 0 and row["overlapped_ms_per_step"] > 0
        assert (
            row["overlapped_vs_sequential"] == row["sequential_ms_per_step"] / row["overlapped_ms_per_step"]
        )
    assert "overlapped speed" in capsys.readouterr().out


def test_bench_overlap_split_step_generates_what_the_engine_generates(tmp_path):
    """The overlapped loop is the engine's own work reordered: same tokens, same text."""
    from concurrent.futures import ThreadPoolExecutor

    from kunlun_runtime import LLM

    bench = load_benchmark("bench_overlap")
    model_dir = make_tiny_model(tmp_path / "tiny", TINY_SPECS["llama-gqa"])
    engine = LLM(str(model_dir), dtype="float32", kv_cache_memory="64MiB").engine
    produced = {}
    with ThreadPoolExecutor(max_workers=1) as pool:
        for mode in bench.MODES:
            engine.block_pool.reset_prefix_cache()  # the second mode recomputes its prompts too
            ids = bench.start_requests(engine, 3, 20, mode, seed=7)
            if mode == "sequential":
                bench.sequential_steps(engine, 6)
            else:
                bench.overlapped_steps(engine, 6, pool)
            tracked = [engine._tracked[r] for r in ids]
            produced[mode] = [(list(t.request.output_token_ids), t.detokenizer.text) for t in tracked]
            for request_id in ids:
                engine.abort_request(request_id)
    assert all(len(tokens) == 7 for tokens, _ in produced["sequential"])  # prefill's token + 6 steps
    assert produced["overlapped"] == produced["sequential"]
    assert engine.block_pool.num_free == engine.block_pool.num_blocks


def test_bench_mixed_step_quick_run(tmp_path, capsys):
    model_dir = make_tiny_model(tmp_path / "tiny", TINY_SPECS["llama-gqa"])
    out = tmp_path / "mixed.json"
    assert (
        load_benchmark("bench_mixed_step").main(["--quick", "--model", str(model_dir), "--json", str(out)])
        == 0
    )
    (row,) = json.loads(out.read_text())
    assert row["split_ms"] > 0 and row["padded_ms"] > 0
    assert row["speedup"] == row["padded_ms"] / row["split_ms"]
    assert "speedup" in capsys.readouterr().out


def test_bench_fork_join_quick_run(tmp_path, capsys):
    out = tmp_path / "fork_join.json"
    argv = ["--regions", "200", "--work", "100", "--reps", "1", "--json", str(out)]
    assert load_benchmark("bench_fork_join").main(argv) == 0
    result = json.loads(out.read_text())
    assert result["threads"] == 2
    assert result["region_s"] > 0 and result["share_s"] > 0 and result["empty_region_s"] > 0
    assert result["overhead_s"] == result["region_s"] - result["share_s"]
    assert "per region beyond the work" in capsys.readouterr().out


@pytest.mark.skipif(
    load_benchmark("bench_prefill_attention").unavailable_reason() is not None,
    reason=str(load_benchmark("bench_prefill_attention").unavailable_reason()),
)
def test_bench_prefill_attention_quick_run_agrees_with_fp64_as_closely_as_sdpa(tmp_path, capsys):
    """The AMX experiment builds, runs, and is as accurate as SDPA's flash kernel against FP64
    (both round the probabilities and the output to BF16), over GQA, MHA, D = 128 and ragged T."""
    out = tmp_path / "prefill_attention.json"
    assert load_benchmark("bench_prefill_attention").main(["--quick", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert len(results["accuracy"]) == 5
    for row in results["accuracy"]:
        assert row["amx_max_abs_err"] <= 1.25 * row["sdpa_max_abs_err"] + 1e-3, row
    row = results["timing"]["40"]
    assert row["amx_speedup"] == row["sdpa_s"] / row["amx_s"]
    assert "amx speed-up" in capsys.readouterr().out


def test_bench_int8_prefill_quick_run(tmp_path, capsys):
    import torch

    from kunlun_runtime.layers import cpu_kernels

    if not cpu_kernels.load(torch.float32):
        pytest.skip(str(cpu_kernels.unavailable_reason(torch.float32)))
    model_dir = make_tiny_model(tmp_path / "tiny", TINY_SPECS["llama-gqa"])
    assert (
        load_benchmark("bench_int8_prefill").main(["--quick", "--model", str(model_dir), "--reps", "1"]) == 0
    )
    printed = capsys.readouterr().out
    assert "one layer's linears, 16 rows: INT8 kernel" in printed
    assert "TTFT 24 tokens: HF FP32" in printed


def test_bench_structured_quick_run_measures_both_sides_side_by_side(tmp_path, monkeypatch, capsys):
    model_dir = make_tiny_model(tmp_path / "tiny", TINY_SPECS["llama-gqa"])
    out = tmp_path / "structured.json"
    monkeypatch.setattr(
        "sys.argv",
        ["bench_structured", "--quick", "--compare-overlap", "--model", str(model_dir), "--json", str(out)],
    )
    load_benchmark("bench_structured").main()
    results = json.loads(out.read_text())
    assert set(results["batches"]) == {"1", "8"} and results["compile_ms"] > 0
    for row in results["batches"].values():
        assert row["free_tok_s"] > 0 and row["constrained_tok_s"] > 0
        assert row["ratio"] == row["constrained_tok_s"] / row["free_tok_s"]
        assert row["mask_us_per_token"] > 0 and row["other_overlap_tok_s"] > 0
    assert "JSON schema" in capsys.readouterr().out

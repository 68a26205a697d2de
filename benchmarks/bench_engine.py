"""Engine benchmark: ours vs HF ``transformers`` ``generate()`` on the same weights, side by side.

Ours runs ``--dtype auto`` (BF16 on CPUs that compute it natively, FP32 over BF16 weights below
that); HF runs its fastest dtype on this CPU's tier (BF16 with AVX-512 BF16, FP32 otherwise: its
emulated BF16 is several times slower). The tier is printed and recorded; ``KUNLUN_CPU_ISA=avx2``
benchmarks the AVX2 tier on an AVX-512 machine.

Every scenario runs the baseline and ours interleaved in the same process, ``--reps`` times, and
reports medians and ratios (these machines are shared and noisy: only ratios from one run mean
anything). Also measures DRAM read bandwidth in the same run for the decode roofline, and an
ablation table (each optimisation switched off in turn). Writes ``results.json`` and a PNG chart.

When ``LLAMA_BENCH`` names llama.cpp's ``llama-bench`` and ``LLAMA_BENCH_GGUF`` a Q8_0 GGUF of the
same model, the INT8 scenario also runs llama.cpp on the same shape (128 tokens decoded after a
256-token context, 2 threads), interleaved with ours, flash attention off and on, the better one
counting; ``LLAMA_BENCH_GGUF_BF16`` (a BF16 GGUF) adds the same comparison for BF16 weights. This
script never downloads or builds llama.cpp: ``benchmarks/build_llama_cpp.sh`` does.

    .venv/bin/python benchmarks/bench_engine.py                  # full run on the embedded SmolLM2
    .venv/bin/python benchmarks/bench_engine.py --quick --model DIR   # smoke run (the test suite)
    LLAMA_BENCH=/path/llama-bench LLAMA_BENCH_GGUF=/path/smollm2-q8_0.gguf .venv/bin/python benchmarks/bench_engine.py
    KUNLUN_CPU_ISA=avx2 LLAMA_BENCH=... .venv/bin/python benchmarks/bench_engine.py  # the AVX2 tier
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kunlun_runtime.layers.attention import fresh_prompt_attention
from kunlun_runtime.layers.linear import onednn_bf16_reason
from kunlun_runtime.platforms.cpu_features import cpu_capabilities


def fastest_dtype() -> torch.dtype:
    """The compute dtype HF and the kernels' floor run in here: BF16 only where it is native."""
    return torch.bfloat16 if cpu_capabilities().computes_bf16 else torch.float32


def median_of(reps: int, fn: Callable[[], float]) -> float:
    return statistics.median(fn() for _ in range(reps))


def measure_bandwidth_gbs(size_mb: int) -> float:
    """DRAM read bandwidth: summing a buffer much larger than the caches."""
    buffer = torch.ones(size_mb * 2**20 // 4, dtype=torch.float32)
    buffer.sum()
    start = time.perf_counter()
    for _ in range(3):
        buffer.sum()
    return 3 * buffer.numel() * 4 / (time.perf_counter() - start) / 1e9


def linear_shapes(config) -> list[tuple[int, int]]:
    """(out, in) of a layer's four projections: fused QKV, o_proj, fused gate/up, down."""
    hidden, inter = config.hidden_size, config.intermediate_size
    return [
        (config.q_size + 2 * config.kv_size, hidden),
        (hidden, config.q_size),
        (2 * inter, hidden),
        (hidden, inter),
    ]


def linear_params_per_layer(config) -> int:
    return sum(n * k for n, k in linear_shapes(config))


def weight_bytes_per_token(config, quantization: str | None) -> int:
    """Bytes of weights one decode step reads: every linear, lm_head included (INT8 or BF16)."""
    linear_bytes = 1 if quantization == "int8" else 2
    return (
        config.num_layers * linear_params_per_layer(config) + config.vocab_size * config.hidden_size
    ) * linear_bytes


def kv_bytes_per_token(config) -> int:
    """Bytes of K and V one token keeps over all layers (BF16 cache)."""
    return config.num_layers * 2 * config.kv_size * 2


def decode_roofline_tok_s(
    bandwidth_gbs: float, weight_bytes: int, kv_bytes: int, batch: int, mean_context: float
) -> float:
    """Aggregate output tok/s if a decode step took only the time to stream what it must read: the
    weights once for the whole batch, and each sequence's K/V (``mean_context`` tokens of it)."""
    return batch * bandwidth_gbs * 1e9 / (weight_bytes + batch * mean_context * kv_bytes)


def prefill_flops(config, tokens: int) -> float:
    """FLOPs of a cold prefill up to its first token: every linear over every token, attention's
    QKᵀ and ·V over the causal triangle, and ``lm_head`` on the last token only."""
    linears = 2 * tokens * linear_params_per_layer(config) * config.num_layers
    attention = 2 * 2 * config.num_layers * config.q_size * tokens * (tokens + 1) / 2
    return linears + attention + 2 * config.vocab_size * config.hidden_size


class PrefillKernels:
    """A prefill's linears and attention alone, in the kernels HF's prefill and ours both call
    (oneDNN's BF16 GEMM through ``F.linear``; SDPA's causal flash kernel, through the engine's own
    ``fresh_prompt_attention``): the time no engine that
    calls them can go below. A distinct weight per layer, so they stream from memory as in a real
    prefill. Timed between the engines' repetitions, since a shared machine's speed drifts over a run."""

    def __init__(self, config, warm_up: list[int]) -> None:
        self.config = config
        shapes = linear_shapes(config)
        self.dtype = fastest_dtype()
        self.weights = [
            torch.randn(n, k, dtype=self.dtype) for _ in range(config.num_layers) for n, k in shapes
        ]
        for tokens in warm_up:
            self.time(tokens)

    def time(self, tokens: int) -> tuple[float, float]:
        """(seconds of the linears, seconds of the attention) at ``tokens`` prompt tokens."""
        config = self.config
        inputs = {k: torch.randn(tokens, k, dtype=self.dtype) for _, k in linear_shapes(config)}
        q = torch.randn(tokens, config.num_heads, config.head_dim, dtype=self.dtype)
        k, v = (torch.randn(tokens, config.num_kv_heads, config.head_dim, dtype=self.dtype) for _ in "kv")
        gqa, scale = config.num_heads != config.num_kv_heads, config.head_dim**-0.5
        start = time.perf_counter()
        for weight in self.weights:
            torch.nn.functional.linear(inputs[weight.shape[1]], weight)
        middle = time.perf_counter()
        for _ in range(config.num_layers):
            fresh_prompt_attention(q, k, v, scale, gqa)
        return middle - start, time.perf_counter() - middle


def llama_bench_from_env() -> tuple[str, str] | None:
    """(llama-bench binary, Q8_0 GGUF) from ``LLAMA_BENCH`` / ``LLAMA_BENCH_GGUF``, or None."""
    binary = os.environ.get("LLAMA_BENCH")
    if not binary:
        return None
    gguf = os.environ.get("LLAMA_BENCH_GGUF")
    if not gguf or not Path(gguf).is_file():
        raise SystemExit(
            f"LLAMA_BENCH is set but LLAMA_BENCH_GGUF ({gguf!r}) is not a file: make a Q8_0 GGUF of the same"
            " weights, e.g. llama-quantize --allow-requantize SmolLM2-135M-Instruct.Q4_1.gguf out.gguf Q8_0"
        )
    return binary, gguf


def llama_bf16_gguf_from_env() -> str | None:
    """A BF16 GGUF of the same weights (``LLAMA_BENCH_GGUF_BF16``) for the BF16 decode comparison."""
    gguf = os.environ.get("LLAMA_BENCH_GGUF_BF16")
    if gguf and not Path(gguf).is_file():
        raise SystemExit(f"LLAMA_BENCH_GGUF_BF16 ({gguf!r}) is not a file (build_llama_cpp.sh writes one)")
    return gguf or None


def llama_bench_decode_rate(binary: str, gguf: str, threads: int, context: int, new_tokens: int) -> float:
    """llama.cpp's decode tok/s for ``new_tokens`` generated after ``context`` tokens: one
    repetition each with flash attention off and on, the faster counting (which one wins depends
    on the CPU and the context length)."""
    command = [binary, "-m", gguf, "-t", str(threads), "-p", "0", "-n", str(new_tokens)]
    command += ["-d", str(context), "-fa", "0,1", "-r", "1", "-o", "json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return max(row["avg_ts"] for row in json.loads(done.stdout))


class Ours:
    def __init__(self, model_dir: str, **options) -> None:
        from kunlun_runtime import LLM

        self.llm = LLM(model_dir, **options)
        self.weight_bytes = weight_bytes_per_token(self.llm.engine.model_config, options.get("quantization"))

    def run(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
        """(seconds to the first token of the first request, total seconds)."""
        from kunlun_runtime import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        start = time.perf_counter()
        first: list[float] = []
        self.llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            params,
            on_output=lambda _o: first.append(time.perf_counter()) if not first else None,
        )
        return first[0] - start, time.perf_counter() - start

    def reset_prefix_cache(self) -> None:
        self.llm.engine.block_pool.reset_prefix_cache()


class HF:
    def __init__(self, model_dir: str, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
        ids = torch.tensor(prompts)
        kwargs = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0}
        start = time.perf_counter()
        self.model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        self.model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        return ttft, time.perf_counter() - start


def prompts_of(batch: int, length: int, vocab: int) -> list[list[int]]:
    return [[(31 * i + 7 * b + 11) % (vocab - 10) + 5 for i in range(length)] for b in range(batch)]


def decode_rate(run: Callable, prompts, new_tokens: int) -> tuple[float, float]:
    """(TTFT seconds, decode output tokens per second after the first token)."""
    ttft, total = run(prompts, new_tokens)
    return ttft, len(prompts) * (new_tokens - 1) / max(total - ttft, 1e-9)


# llama_bench_decode_rate counts the better of two runs (flash attention off and on). Where the
# two decode alike (a Zen 3 at these contexts), that is the better of two samples of one rate,
# which a shared machine's noise lifts; ours beside it gets as many.
RUNS_PER_LLAMA_SAMPLE = 2


def best_decode_rate(
    run: Callable, prompts, new_tokens: int, runs: int = RUNS_PER_LLAMA_SAMPLE, first: float | None = None
) -> float:
    """The best decode tok/s of ``runs`` runs: as many samples per repetition as llama.cpp's
    (``first``: the rate of a run already made, one of them)."""
    rates = [] if first is None else [first]
    rates += [decode_rate(run, prompts, new_tokens)[1] for _ in range(runs - len(rates))]
    return max(rates)


def run_scenarios(args: argparse.Namespace) -> dict:
    from kunlun_runtime.models.model_dir import resolve_model_dir

    model_dir = args.model or str(resolve_model_dir(None))
    llama = llama_bench_from_env()  # checked first: a missing GGUF should not cost a whole run
    torch.set_num_threads(args.threads)
    sizes = {"prompt": 256, "new": 128, "batch": 8, "batch_prompt": 128, "long": 2048, "history": 2000}
    if args.quick:
        sizes = {"prompt": 16, "new": 8, "batch": 2, "batch_prompt": 8, "long": 48, "history": 40}
    common = {"dtype": "auto", "max_model_len": max(sizes["long"], sizes["history"]) + 64 + sizes["new"]}
    ours = Ours(model_dir, kv_cache_memory="1GiB", **common)
    hf = HF(model_dir, fastest_dtype())
    vocab = ours.llm.engine.model_config.vocab_size
    results: dict = {
        "model": model_dir,
        "threads": args.threads,
        "sizes": sizes,
        "cpu": cpu_capabilities().describe(),
        "ours_dtype": str(ours.llm.engine.dtype).removeprefix("torch."),
        "ours_weight_dtype": str(ours.llm.engine.weight_dtype).removeprefix("torch."),
        "hf_dtype": str(fastest_dtype()).removeprefix("torch."),
        "scenarios": {},
    }
    # Bandwidth is sampled at the start, middle and end, and the best sample is the roofline: on a
    # shared machine a neighbour's burst lowers one sample, and a lowered roofline would flatter us.
    bandwidth_mb = 64 if args.quick else 1024
    samples = [measure_bandwidth_gbs(bandwidth_mb)]

    single = prompts_of(1, sizes["prompt"], vocab)
    batch = prompts_of(sizes["batch"], sizes["batch_prompt"], vocab)
    long_prompt = prompts_of(1, sizes["long"], vocab)
    for _ in range(1):  # warm-up both
        ours.run(single, 4)
        hf.run(single, 4)
    table = results["scenarios"]
    config = ours.llm.engine.model_config
    kernels = PrefillKernels(config, warm_up=[sizes["prompt"], sizes["long"]])

    def side_by_side(name: str, prompts, new_tokens: int, caching_off: bool = True) -> None:
        rows = {"ours": [], "hf": []}
        floors = []
        for _ in range(args.reps):
            if caching_off:
                ours.reset_prefix_cache()
            rows["ours"].append(decode_rate(ours.run, prompts, new_tokens))
            rows["hf"].append(decode_rate(hf.run, prompts, new_tokens))
            if len(prompts) == 1:  # a single prompt's TTFT: the kernels' floor, in the same rhythm
                floors.append(kernels.time(len(prompts[0])))
        entry = {}
        if floors:
            entry["onednn_linears_s"] = statistics.median(f[0] for f in floors)
            entry["sdpa_attention_s"] = statistics.median(f[1] for f in floors)
        for who, values in rows.items():
            entry[f"{who}_ttft_s"] = statistics.median(v[0] for v in values)
            entry[f"{who}_decode_tok_s"] = statistics.median(v[1] for v in values)
        if new_tokens <= 2:  # a TTFT scenario: there is no decode phase to rate
            for who in rows:
                del entry[f"{who}_decode_tok_s"]
        else:
            entry["decode_speedup"] = entry["ours_decode_tok_s"] / entry["hf_decode_tok_s"]
        entry["ttft_ratio"] = entry["ours_ttft_s"] / entry["hf_ttft_s"]
        table[name] = entry

    side_by_side("single_256_128", single, sizes["new"])
    llama_bf16 = llama_bf16_gguf_from_env() if llama is not None else None
    if llama_bf16 is not None:  # BF16 weights on both sides, interleaved
        ours_rates, llama_rates = [], []
        for _ in range(args.reps):
            ours_rates.append(best_decode_rate(ours.run, single, sizes["new"]))
            llama_rates.append(
                llama_bench_decode_rate(llama[0], llama_bf16, args.threads, sizes["prompt"], sizes["new"])
            )
        table["single_256_128"]["llama_cpp_bf16_tok_s"] = statistics.median(llama_rates)
        table["single_256_128"]["vs_llama_cpp_bf16"] = statistics.median(ours_rates) / statistics.median(
            llama_rates
        )
    side_by_side("batch8_128_128", batch, sizes["new"])
    samples.append(measure_bandwidth_gbs(bandwidth_mb))
    side_by_side("long_2048_ttft", long_prompt, 2)

    int8 = Ours(model_dir, kv_cache_memory="1GiB", quantization="int8", **common)
    int8_rates, int8_best, llama_rates = [], [], []
    for _ in range(args.reps):  # interleaved with llama.cpp when it is given
        int8_rates.append(decode_rate(int8.run, single, sizes["new"])[1])
        if llama is not None:  # the best of as many runs as llama.cpp's sample takes
            int8_best.append(best_decode_rate(int8.run, single, sizes["new"], first=int8_rates[-1]))
            llama_rates.append(llama_bench_decode_rate(*llama, args.threads, sizes["prompt"], sizes["new"]))
    table["int8_single"] = {
        "int8_decode_tok_s": statistics.median(int8_rates),
        "vs_bf16": statistics.median(int8_rates) / table["single_256_128"]["ours_decode_tok_s"],
    }
    if llama_rates:
        table["int8_single"]["llama_cpp_q8_0_tok_s"] = statistics.median(llama_rates)
        table["int8_single"]["vs_llama_cpp_q8_0"] = statistics.median(int8_best) / statistics.median(
            llama_rates
        )
    int8_weight_bytes = int8.weight_bytes
    del int8

    history = prompts_of(1, sizes["history"], vocab)[0]
    follow_up = [[*history, 42, 43, 44]]
    cold, warm = [], []
    for _ in range(args.reps):
        ours.reset_prefix_cache()
        cold.append(ours.run(follow_up, 1)[0])
        ours.reset_prefix_cache()
        ours.run([history], 1)  # the first turn
        warm.append(ours.run(follow_up, 1)[0])
    table["second_turn_reuse"] = {
        "cold_ttft_s": statistics.median(cold),
        "warm_ttft_s": statistics.median(warm),
        "speedup": statistics.median(cold) / statistics.median(warm),
    }
    results["ablation"] = run_ablation(args, model_dir, common, single, sizes["new"])
    samples.append(measure_bandwidth_gbs(bandwidth_mb))
    bandwidth = max(samples)
    results["bandwidth_gbs"], results["bandwidth_samples_gbs"] = bandwidth, samples
    results["roofline_tok_s_bf16"] = bandwidth * 1e9 / ours.weight_bytes
    table["single_256_128"]["roofline_fraction"] = (
        table["single_256_128"]["ours_decode_tok_s"] / results["roofline_tok_s_bf16"]
    )
    table["int8_single"]["roofline_tok_s_int8"] = bandwidth * 1e9 / int8_weight_bytes
    table["int8_single"]["roofline_fraction"] = (
        table["int8_single"]["int8_decode_tok_s"] / table["int8_single"]["roofline_tok_s_int8"]
    )
    add_limits(results, config, ours.weight_bytes, sizes)
    return results


def add_limits(results: dict, config, weight_bytes: int, sizes: dict) -> None:
    """What stands in the targets' way, from the same run's measurements: the batch's decode
    roofline (its bytes at the measured bandwidth), and each TTFT's floor in the kernels HF and we
    both call (``PrefillKernels``, timed between the repetitions); each also as a ratio to HF."""
    table = results["scenarios"]
    batch = table["batch8_128_128"]
    batch["mean_context"] = sizes["batch_prompt"] + sizes["new"] / 2
    batch["roofline_tok_s"] = decode_roofline_tok_s(
        results["bandwidth_gbs"],
        weight_bytes,
        kv_bytes_per_token(config),
        sizes["batch"],
        batch["mean_context"],
    )
    batch["roofline_fraction"] = batch["ours_decode_tok_s"] / batch["roofline_tok_s"]
    batch["roofline_vs_hf"] = batch["roofline_tok_s"] / batch["hf_decode_tok_s"]
    for name, tokens in (("single_256_128", sizes["prompt"]), ("long_2048_ttft", sizes["long"])):
        row = table[name]
        row["kernels_floor_s"] = row["onednn_linears_s"] + row["sdpa_attention_s"]
        row["kernels_floor_vs_hf_ttft"] = row["kernels_floor_s"] / row["hf_ttft_s"]
        row["ours_prefill_tflops"] = prefill_flops(config, tokens) / row["ours_ttft_s"] / 1e12
        row["kernels_prefill_tflops"] = prefill_flops(config, tokens) / row["kernels_floor_s"] / 1e12


ABLATIONS = {
    "all on": {},
    "no native norm/attention/layer-stack kernels": {"native_kernels": False},
    "oneDNN-prepacked linears (no native)": {"linear_backend": "prepacked"},
    "neither native (the oneDNN engine)": {"native_kernels": False, "linear_backend": "prepacked"},
    "oneDNN engine, unfused attention": {
        "native_kernels": False,
        "linear_backend": "prepacked",
        "fused_attention": False,
    },
    "oneDNN engine, plain linears": {"native_kernels": False, "linear_backend": "plain"},
    "no cache-set skew": {"kv_block_skew": False},
}


def ablations() -> dict[str, dict]:
    """ABLATIONS less those this tier cannot run (oneDNN's BF16 weights need native BF16)."""
    prepacked_runs = fastest_dtype() == torch.bfloat16 and onednn_bf16_reason() is None
    return {
        name: opts
        for name, opts in ABLATIONS.items()
        if prepacked_runs or opts.get("linear_backend") != "prepacked"
    }


def run_ablation(args, model_dir: str, common: dict, prompts, new_tokens: int) -> dict:
    chosen = ablations()
    engines = {
        name: Ours(model_dir, kv_cache_memory="1GiB", **common, **opts) for name, opts in chosen.items()
    }
    rates: dict[str, list[float]] = {name: [] for name in chosen}
    for _ in range(args.reps):  # interleaved
        for name, engine in engines.items():
            engine.reset_prefix_cache()
            rates[name].append(decode_rate(engine.run, prompts, new_tokens)[1])
    base = statistics.median(rates["all on"])
    return {
        name: {"decode_tok_s": statistics.median(r), "vs_all_on": statistics.median(r) / base}
        for name, r in rates.items()
    }


def format_table(results: dict) -> str:
    cpu = results["cpu"]
    lines = [
        f"cpu {cpu['model_name']}  ISA tier {cpu['isa_tier']} (detected {cpu['detected_isa_tier']})  ours"
        f" {results['ours_dtype']} over {results['ours_weight_dtype']} weights, HF {results['hf_dtype']}",
        f"model {results['model']}  threads {results['threads']}  DRAM read {results['bandwidth_gbs']:.1f} GB/s"
        f" (best of {', '.join(f'{g:.1f}' for g in results['bandwidth_samples_gbs'])})",
    ]
    single = results["scenarios"]["single_256_128"]
    lines.append(
        f"BF16 decode roofline {results['roofline_tok_s_bf16']:.1f} tok/s; ours reaches"
        f" {single['roofline_fraction']:.0%} of it"
    )
    if "vs_llama_cpp_bf16" in single:
        lines.append(
            f"BF16 weights, single decode: llama.cpp {single['llama_cpp_bf16_tok_s']:.1f} tok/s; ours"
            f" {single['vs_llama_cpp_bf16']:.2f}x of it (interleaved)"
        )
    batch = results["scenarios"]["batch8_128_128"]
    lines.append(
        f"batch decode roofline {batch['roofline_tok_s']:.1f} tok/s (weights once per step, each sequence's"
        f" K/V at {batch['mean_context']:.0f} tokens): ours reaches {batch['roofline_fraction']:.0%} of it;"
        f" it is {batch['roofline_vs_hf']:.2f}x HF"
    )
    for name in ("single_256_128", "long_2048_ttft"):
        row = results["scenarios"][name]
        lines.append(
            f"{name} TTFT floor, its linears and attention alone in the kernels HF also calls:"
            f" {row['onednn_linears_s']:.3f}s + {row['sdpa_attention_s']:.3f}s"
            f" = {row['kernels_floor_vs_hf_ttft']:.2f} of HF's TTFT ({row['kernels_prefill_tflops']:.2f} TFLOPS;"
            f" ours {row['ours_prefill_tflops']:.2f})"
        )
    lines.append(
        f"{'scenario':<20}{'ours tok/s':>12}{'HF tok/s':>10}{'speedup':>9}{'ours TTFT':>11}{'HF TTFT':>9}{'ratio':>7}"
    )
    for name, row in results["scenarios"].items():
        if "hf_ttft_s" in row and "hf_decode_tok_s" not in row:
            lines.append(
                f"{name:<20}{'-':>12}{'-':>10}{'-':>9}{row['ours_ttft_s']:>10.3f}s{row['hf_ttft_s']:>8.3f}s"
                f"{row['ttft_ratio']:>7.2f}"
            )
        elif "hf_decode_tok_s" in row:
            lines.append(
                f"{name:<20}{row['ours_decode_tok_s']:>12.1f}{row['hf_decode_tok_s']:>10.1f}{row['decode_speedup']:>8.2f}x"
                f"{row['ours_ttft_s']:>10.3f}s{row['hf_ttft_s']:>8.3f}s{row['ttft_ratio']:>7.2f}"
            )
        else:
            lines.append(f"{name:<20}" + "  ".join(f"{k}={v:.3f}" for k, v in row.items()))
    lines.append("ablation (single request decode):")
    for name, row in results["ablation"].items():
        lines.append(f"  {name:<46}{row['decode_tok_s']:>8.1f} tok/s  {row['vs_all_on']:.2f}x of all-on")
    return "\n".join(lines)


def write_chart(results: dict, path: Path) -> None:
    """Bars of ours-vs-HF ratios (> 1 is better for us): decode throughput and TTFT speed-up."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, ratios = [], []
    for name, row in results["scenarios"].items():
        if "decode_speedup" in row:
            labels.append(f"{name}\ndecode")
            ratios.append(row["decode_speedup"])
        if "ttft_ratio" in row:
            labels.append(f"{name}\nTTFT")
            ratios.append(1 / row["ttft_ratio"])
    labels.append("INT8 decode\nvs our BF16")
    ratios.append(results["scenarios"]["int8_single"]["vs_bf16"])
    if "vs_llama_cpp_q8_0" in results["scenarios"]["int8_single"]:
        labels.append("INT8 decode\nvs llama.cpp Q8_0")
        ratios.append(results["scenarios"]["int8_single"]["vs_llama_cpp_q8_0"])
    labels.append("2nd turn TTFT\nwarm vs cold")
    ratios.append(results["scenarios"]["second_turn_reuse"]["speedup"])
    figure, axis = plt.subplots(figsize=(9, 3.8))
    axis.bar(range(len(ratios)), ratios, color=["tab:green" if r >= 1 else "tab:red" for r in ratios])
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_xticks(range(len(ratios)), labels, fontsize=7)
    axis.set_yscale("log")
    axis.set_ylabel("speed-up (x, log scale)")
    axis.set_title("kunlun-runtime speed-ups, same run (median): vs HF transformers unless labelled")
    figure.tight_layout()
    figure.savefig(path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF-format directory (default: embedded SmolLM2)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that it runs")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    results = run_scenarios(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    write_chart(results, args.out / "engine.png")
    print(format_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""INT8 prefill on the tier in force: our INT8 kernel against oneDNN's SGEMM over the same weights
in FP32 (one layer's linears, at several prompt sizes), and TTFT with INT8 weights against BF16
weights and HF ``transformers`` FP32, interleaved in one process.

On the AVX2 tier (FP32 activations) INT8 linears of every size run the W8A8 kernel; this is the
measurement behind that choice. Run it with ``KUNLUN_CPU_ISA=avx2`` on an AVX-512 machine.

    KUNLUN_CPU_ISA=avx2 .venv/bin/python benchmarks/bench_int8_prefill.py
    .venv/bin/python benchmarks/bench_int8_prefill.py --quick --model DIR   # smoke run (the test suite)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kunlun_runtime.layers import cpu_kernels
from kunlun_runtime.layers.linear import quantize_per_channel_int8
from kunlun_runtime.platforms.cpu_features import cpu_capabilities


def linear_shapes(config) -> list[tuple[int, int]]:
    """(N, K) of one layer's linears: qkv, o, gate_up, down."""
    qkv = config.q_size + 2 * config.kv_size
    hidden, inner = config.hidden_size, config.intermediate_size
    return [(qkv, hidden), (hidden, config.q_size), (2 * inner, hidden), (hidden, inner)]


def best_of(reps: int, fn) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def kernel_vs_sgemm(config, rows: list[int], reps: int) -> dict[int, dict[str, float]]:
    """Seconds of one layer's linears: our INT8 kernel (FP32 activations) and F.linear over the
    dequantized FP32 weights, alternated."""
    generator = torch.Generator().manual_seed(0)
    weights = []
    for n, k in linear_shapes(config):
        q, scales = quantize_per_channel_int8(torch.randn(n, k, generator=generator))
        weights.append((q, scales, q.float() * scales[:, None]))
    results = {}
    for m in rows:
        inputs = {k: torch.randn(m, k, generator=generator) for _, k in linear_shapes(config)}
        ours = sgemm = 0.0
        for q, scales, dense in weights:
            x = inputs[q.shape[1]]
            ours += best_of(reps, lambda x=x, q=q, scales=scales: cpu_kernels.linear_int8(x, q, scales, None))
            sgemm += best_of(reps, lambda x=x, dense=dense: torch.nn.functional.linear(x, dense))
        results[m] = {"int8_kernel_s": ours, "fp32_sgemm_s": sgemm, "speedup": sgemm / ours}
    return results


def ttft(model_dir: str, lengths: list[int], reps: int, vocab_limit: int) -> dict[int, dict[str, float]]:
    from transformers import AutoModelForCausalLM

    from kunlun_runtime import LLM, SamplingParams

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engines = {
        name: LLM(
            model_dir, kv_cache_memory="1GiB", quantization=quantization, max_model_len=max(lengths) + 16
        )
        for name, quantization in (("bf16_weights", None), ("int8", "int8"))
    }
    params = SamplingParams(temperature=0, max_tokens=1)

    def ours(llm, prompt) -> float:
        llm.engine.block_pool.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params)
        return time.perf_counter() - start

    @torch.inference_mode()
    def reference(prompt) -> float:
        start = time.perf_counter()
        hf.generate(
            torch.tensor([prompt]), max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0
        )
        return time.perf_counter() - start

    results = {}
    for length in lengths:
        prompt = [(31 * i + 11) % (vocab_limit - 10) + 5 for i in range(length)]
        times: dict[str, list[float]] = {"hf_fp32": [], **{name: [] for name in engines}}
        for _ in range(reps):  # interleaved
            times["hf_fp32"].append(reference(prompt))
            for name, llm in engines.items():
                times[name].append(ours(llm, prompt))
        row = {f"{name}_s": statistics.median(values) for name, values in times.items()}
        row["bf16_weights_vs_hf"] = row["bf16_weights_s"] / row["hf_fp32_s"]
        row["int8_vs_hf"] = row["int8_s"] / row["hf_fp32_s"]
        results[length] = row
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF-format directory (default: embedded SmolLM2)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that it runs")
    args = parser.parse_args(argv)
    from kunlun_runtime.models.model_config import load_model_config
    from kunlun_runtime.models.model_dir import resolve_model_dir

    torch.set_num_threads(args.threads)
    if not cpu_kernels.load(torch.float32):
        raise SystemExit(
            f"no INT8 kernel for FP32 activations here: {cpu_kernels.unavailable_reason(torch.float32)}"
        )
    model_dir = str(resolve_model_dir(args.model))
    config = load_model_config(resolve_model_dir(args.model))
    rows, lengths = ([4, 16], [8, 24]) if args.quick else ([16, 64, 256], [256, 2048])
    print(f"{cpu_capabilities().summary()}; {model_dir}")
    for m, row in kernel_vs_sgemm(config, rows, args.reps).items():
        print(
            f"one layer's linears, {m} rows: INT8 kernel {row['int8_kernel_s'] * 1e3:.2f} ms, FP32 SGEMM"
            f" {row['fp32_sgemm_s'] * 1e3:.2f} ms: {row['speedup']:.2f}x"
        )
    for length, row in ttft(model_dir, lengths, args.reps, config.vocab_size).items():
        print(
            f"TTFT {length} tokens: HF FP32 {row['hf_fp32_s']:.3f} s; ours BF16 weights {row['bf16_weights_s']:.3f} s"
            f" ({row['bf16_weights_vs_hf']:.2f}), INT8 {row['int8_s']:.3f} s ({row['int8_vs_hf']:.2f})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

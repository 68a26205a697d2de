"""The AVX-512 linears' two weight-prefetch orders, side by side in one process.

At decode a linear streams its weight from DRAM once per step, and software prefetches keep the
stream ahead of the arithmetic. The AVX-512 tier has two orders (``weight_prefetch()``):
``rows-l2`` (each row of a block prefetches its own line into L2, tuned on a Xeon) and
``stream-l1`` (the thread's weight in address order into L1); it picks one by CPU vendor. This
switches between them with ``set_weight_prefetch`` inside each repetition, so both see the same
machine state, and reports medians and the ratio ``stream-l1`` / ``rows-l2``:

1. the linears alone: every projection of the model's decoder layers and the LM head, random
   weights of the model's shapes (BF16 at 1, 2 and 8 rows; INT8 at 1 row), each policy's outputs
   checked bit-equal to the other's (the order of prefetches must not change a result);
2. the engine: one request's decode (``--new`` tokens after ``--prompt``), BF16 and INT8 weights.

    .venv/bin/python benchmarks/bench_weight_prefetch.py              # ~3 minutes on 2 cores

The AVX2 tier has one order (``stream-l1``): there this exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_engine import (  # benchmarks/, beside this
    Ours,
    decode_rate,
    linear_shapes,
    measure_bandwidth_gbs,
    prompts_of,
    weight_bytes_per_token,
)

from kunlun_runtime.layers import cpu_kernels
from kunlun_runtime.platforms.cpu_features import IsaTier, cpu_capabilities

POLICIES = ("rows-l2", "stream-l1")
LINEAR_CASES = (("bf16", 1), ("bf16", 2), ("bf16", 8), ("int8", 1))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF-format directory (default: embedded SmolLM2)")
    parser.add_argument("--reps", type=int, default=20, help="repetitions of the linears' pass")
    parser.add_argument("--engine-reps", type=int, default=5, help="repetitions of the engine's decode")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--bandwidth-mb", type=int, default=512)
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args(argv)


def random_weight(fmt: str, n: int, k: int) -> torch.Tensor:
    if fmt == "int8":
        return torch.randint(-127, 128, (n, k), dtype=torch.int8)
    return (torch.randn(n, k) * 0.05).to(torch.bfloat16)


def time_linears(ops, config, fmt: str, rows: int, reps: int) -> dict[str, list[float]]:
    """Seconds per pass over every layer's linears and the LM head, per policy, alternating."""
    shapes = linear_shapes(config)
    layers = [[random_weight(fmt, n, k) for n, k in shapes] for _ in range(config.num_layers)]
    head = random_weight(fmt, config.vocab_size, config.hidden_size)
    scales = {w.shape[0]: torch.rand(w.shape[0]) * 0.01 for w in [*layers[0], head]}
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]).to(torch.bfloat16) for w in [*layers[0], head]}

    def linear(w: torch.Tensor) -> torch.Tensor:
        x = inputs[w.shape[1]]
        return (
            ops.linear_int8(x, w, scales[w.shape[0]], None) if fmt == "int8" else ops.linear_bf16(x, w, None)
        )

    seconds: dict[str, list[float]] = {policy: [] for policy in POLICIES}
    outputs: dict[str, list[torch.Tensor]] = {}
    for _ in range(reps):
        for policy in POLICIES:
            ops.set_weight_prefetch(policy)
            start = time.perf_counter()
            results = [linear(w) for layer in layers for w in layer] + [linear(head)]
            seconds[policy].append(time.perf_counter() - start)
            outputs.setdefault(policy, results)
    for ours, theirs in zip(outputs[POLICIES[0]], outputs[POLICIES[1]], strict=True):
        if not torch.equal(ours, theirs):
            raise SystemExit("the two prefetch orders gave different results: a kernel bug")
    return seconds


def run(args: argparse.Namespace) -> dict:
    from kunlun_runtime.models.model_dir import resolve_model_dir

    torch.set_num_threads(args.threads)
    model_dir = args.model or str(resolve_model_dir(None))
    common = {"dtype": "auto", "max_model_len": args.prompt + args.new + 64, "kv_cache_memory": "256MiB"}
    engines = {"bf16": Ours(model_dir, **common), "int8": Ours(model_dir, **common, quantization="int8")}
    ops = torch.ops.kunlun_avx512
    default = ops.weight_prefetch()
    config = engines["bf16"].llm.engine.model_config
    results: dict = {
        "cpu": cpu_capabilities().describe(),
        "default_policy": default,
        "linears": {},
        "engine": {},
    }
    try:
        _measure(args, ops, engines, config, results)
    finally:  # the process's order as it was, whatever happened
        ops.set_weight_prefetch(default)
    results["dram_read_gb_s"] = measure_bandwidth_gbs(args.bandwidth_mb)
    return results


def _measure(args: argparse.Namespace, ops, engines: dict[str, Ours], config, results: dict) -> None:
    for fmt, rows in LINEAR_CASES:
        seconds = time_linears(ops, config, fmt, rows, args.reps)
        weight_bytes = weight_bytes_per_token(config, "int8" if fmt == "int8" else None)
        medians = {policy: statistics.median(values) for policy, values in seconds.items()}
        results["linears"][f"{fmt} x{rows}"] = {
            "ms": {policy: 1e3 * value for policy, value in medians.items()},
            "gb_s": {policy: weight_bytes / value / 1e9 for policy, value in medians.items()},
            "ratio": medians["rows-l2"] / medians["stream-l1"],
        }
    prompt = prompts_of(1, args.prompt, config.vocab_size)
    for engine in engines.values():
        engine.run(prompt, 4)  # warm-up
    rates: dict[str, dict[str, list[float]]] = {fmt: {p: [] for p in POLICIES} for fmt in engines}
    for _ in range(args.engine_reps):
        for fmt, engine in engines.items():
            for policy in POLICIES:
                ops.set_weight_prefetch(policy)
                engine.reset_prefix_cache()
                rates[fmt][policy].append(decode_rate(engine.run, prompt, args.new)[1])
    for fmt, samples in rates.items():
        medians = {policy: statistics.median(values) for policy, values in samples.items()}
        results["engine"][fmt] = {
            "tok_s": medians,
            "ratio": medians["stream-l1"] / medians["rows-l2"],
            "samples": samples,
        }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cpu = cpu_capabilities()
    if cpu.tier not in (IsaTier.AVX512, IsaTier.AMX) or not cpu_kernels.load(torch.bfloat16):
        print(f"bench_weight_prefetch: the {cpu.tier.value} tier has one prefetch order; nothing to compare")
        return 2
    results = run(args)
    print(
        f"{results['cpu']}; {args.threads} threads; DRAM read {results['dram_read_gb_s']:.1f} GB/s; "
        f"default here: {results['default_policy']}"
    )
    for case, row in results["linears"].items():
        ms = row["ms"]
        print(
            f"linears {case}: rows-l2 {ms['rows-l2']:.2f} ms, stream-l1 {ms['stream-l1']:.2f} ms, "
            f"{row['ratio']:.3f}x (medians of {args.reps})"
        )
    for fmt, row in results["engine"].items():
        tok = row["tok_s"]
        print(
            f"engine {fmt}: rows-l2 {tok['rows-l2']:.1f} tok/s, stream-l1 {tok['stream-l1']:.1f} tok/s, "
            f"{row['ratio']:.3f}x (medians of {args.engine_reps})"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

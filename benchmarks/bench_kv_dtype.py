"""KV cache dtype benchmark: a BF16 KV cache against an FP32 one under FP32 activations, side by side.

On CPUs without native BF16 (the AVX2 tier, the plain floor) the engine computes in FP32; its KV
cache can store FP32 or BF16 K/V (``--kv-cache-dtype``; BF16 is widened to FP32 as attention reads
it). This measures what the choice costs and buys, in one process so the two share the machine's
state: decode speed at long contexts (batch 1 and a small batch; the contexts are prefilled, then
``--new-tokens`` decode steps are timed) and the tokens a GiB of ``--kv-cache-memory`` holds.

The two engines run interleaved, ``--reps`` times, and the medians and their ratio (BF16 / FP32
decode tokens per second) are printed: timings on shared machines move between runs, ratios from
one run are what count. The ISA tier is set before the runtime is imported (``--isa``, default
``avx2``: the AVX2 tier, also on an AVX-512 machine); it must be one this CPU runs.

    KUNLUN_CPU_ISA=avx2 .venv/bin/python benchmarks/bench_kv_dtype.py            # SmolLM2, 2k and 8k
    .venv/bin/python benchmarks/bench_kv_dtype.py --isa none --contexts 2048      # the plain floor
    .venv/bin/python benchmarks/bench_kv_dtype.py --quick --model DIR --json out.json  # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

KV_DTYPES = ("float32", "bfloat16")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF-format model directory (default: embedded SmolLM2)")
    parser.add_argument("--isa", default="avx2", help="KUNLUN_CPU_ISA for this run (default: avx2)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--new-tokens", type=int, default=32, help="decode steps timed per measurement")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: torch's; 1 on a machine others load)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny contexts, one rep (the smoke test)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    if args.quick:
        args.contexts, args.batches, args.new_tokens, args.reps = [40, 100], [1, 2], 4, 1
    return args


def make_engine(
    model: str | None,
    kv_cache_dtype: str,
    memory_bytes: int,
    max_model_len: int,
    max_seqs: int,
    step_tokens: int,
):
    from kunlun_runtime.config import EngineConfig
    from kunlun_runtime.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model=model,
        dtype="auto",
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_memory_bytes=memory_bytes,
        max_model_len=max_model_len,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=step_tokens,
    )
    return LLMEngine(config)


def run_to_end(engine, prompt: list[int], params) -> None:
    engine.add_request(f"warm-{time.monotonic_ns()}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()


def decode_tok_s(engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Prefill ``prompts`` (their first token included), then time the decode steps until every
    sequence has ``new_tokens``; returns the tokens those steps decoded per second. The prompts are
    prefilled one by one first, into the prefix cache: long prompts prefilled in one step would
    attend padded to each other."""
    from kunlun_runtime import SamplingParams

    for prompt in prompts:
        run_to_end(engine, prompt, SamplingParams(temperature=0, max_tokens=1))
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    ids = [f"r{index}-{time.monotonic_ns()}" for index in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    produced = dict.fromkeys(ids, 0)
    while min(produced.values()) == 0:  # prefill (chunked): every sequence has its first token
        for output in engine.step():
            produced[output.request_id] = len(output.outputs[0].token_ids)
    decoded = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        decoded += len(engine.step())  # one output per sequence that gained a token
    elapsed = time.perf_counter() - start
    return decoded / elapsed


def tokens_per_gib(engine) -> int:
    """The tokens a GiB of ``--kv-cache-memory`` holds in ``engine``'s cache (its blocks as laid
    out, padding included, as the engine plans them)."""
    cache = engine.kv_cache
    return (2**30 // (cache.nbytes // cache.num_blocks)) * engine.config.block_size


def fp32_budget_bytes(config, num_tokens: int) -> int:
    """A KV budget that holds ``num_tokens`` FP32 K/V tokens of ``config``'s model, block padding included."""
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4
    return int(1.25 * per_token * num_tokens) + (1 << 20)


def run(args: argparse.Namespace) -> dict:
    import torch

    from kunlun_runtime.models.model_config import load_model_config
    from kunlun_runtime.models.model_dir import resolve_model_dir
    from kunlun_runtime.platforms.cpu_features import cpu_capabilities

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    capabilities = cpu_capabilities()
    config = load_model_config(resolve_model_dir(args.model))
    # A context the model cannot hold with its new tokens is shortened to the longest it can.
    contexts = [min(context, config.max_position_embeddings - args.new_tokens) for context in args.contexts]
    max_model_len = max(contexts) + args.new_tokens
    budget = fp32_budget_bytes(config, max(args.batches) * max_model_len)
    step_tokens = max(2048, max_model_len)  # a whole prompt in one step
    engines = {
        kv: make_engine(args.model, kv, budget, max_model_len, max(args.batches), step_tokens)
        for kv in KV_DTYPES
    }
    vocab = engines["float32"].model_config.vocab_size
    rng = random.Random(0)
    results: dict = {
        "cpu": capabilities.model_name,
        "isa_tier": capabilities.tier.value,
        "activation_dtype": str(engines["float32"].dtype).removeprefix("torch."),
        "kv_cache_dtypes": {kv: str(engines[kv].kv_cache_dtype).removeprefix("torch.") for kv in KV_DTYPES},
        "new_tokens": args.new_tokens,
        "threads": torch.get_num_threads(),
        "decode": {},
    }
    for context in contexts:
        for batch in args.batches:
            prompts = [[rng.randrange(3, vocab) for _ in range(context)] for _ in range(batch)]
            times: dict[str, list[float]] = {kv: [] for kv in KV_DTYPES}
            for _ in range(args.reps):
                for kv in KV_DTYPES:  # interleaved: both see the same machine state
                    times[kv].append(decode_tok_s(engines[kv], prompts, args.new_tokens))
            row = {f"{kv}_tok_s": statistics.median(times[kv]) for kv in KV_DTYPES}
            row["bf16_vs_fp32"] = row["bfloat16_tok_s"] / row["float32_tok_s"]
            results["decode"][f"{context}x{batch}"] = {"context": context, "batch": batch, **row}
            print(
                f"context {context:>6} batch {batch:>2}: decode FP32 KV {row['float32_tok_s']:8.1f} tok/s, "
                f"BF16 KV {row['bfloat16_tok_s']:8.1f} tok/s, BF16/FP32 x{row['bf16_vs_fp32']:.2f}",
                flush=True,
            )
    held = {kv: tokens_per_gib(engines[kv]) for kv in KV_DTYPES}
    for engine in engines.values():
        engine.close()
    results["tokens_per_gib"] = held
    results["tokens_per_gib_ratio"] = held["bfloat16"] / held["float32"]
    print(
        f"tokens held per GiB of --kv-cache-memory: FP32 KV {held['float32']}, BF16 KV {held['bfloat16']}, "
        f"BF16/FP32 x{results['tokens_per_gib_ratio']:.2f}"
    )
    print(
        f"({results['cpu']}, ISA tier {results['isa_tier']}, activations {results['activation_dtype']}, "
        f"{results['threads']} threads)"
    )
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "kunlun_runtime" in sys.modules and os.environ.get("KUNLUN_CPU_ISA") != args.isa:
        # The tier is read once per process: set it before the runtime is imported.
        raise SystemExit(
            f"--isa {args.isa}: run this script as its own process (the runtime is already loaded)"
        )
    os.environ["KUNLUN_CPU_ISA"] = args.isa
    results = run(args)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

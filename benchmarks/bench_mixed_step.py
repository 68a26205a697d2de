"""Mixed-step benchmark: one engine step that carries decodes and a prefill chunk together (what
continuous batching with chunked prefill runs under load), with the batch's attention split into
its decode and prefill parts (the engine's way) against all sequences padded to the longest chunk
(the way before), interleaved in one process on the same model and KV pool.

    .venv/bin/python benchmarks/bench_mixed_step.py                      # SmolLM2 BF16, 2 threads
    .venv/bin/python benchmarks/bench_mixed_step.py --quick --model DIR  # smoke run (the test suite)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kunlun_runtime.layers import attention

WAYS = ("split", "padded")


def step_inputs(engine, decodes: int, decode_context: int, chunk: int, chunk_start: int):
    """StepInputs for ``decodes`` sequences at ``decode_context`` tokens plus one ``chunk``-token
    prefill chunk after ``chunk_start`` cached tokens; block tables over distinct pool blocks."""
    from kunlun_runtime.models.forward import StepInputs

    block = engine.kv_cache.spec.block_size
    inputs, next_block = StepInputs(), 0
    for query_len, context in [(1, decode_context)] * decodes + [(chunk, chunk_start + chunk)]:
        blocks = -(-context // block)
        inputs.block_tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
        inputs.token_ids.extend([7] * query_len)
        inputs.positions.extend(range(context - query_len, context))
        inputs.query_lens.append(query_len)
        inputs.context_lens.append(context)
    return inputs


def time_step(engine, inputs, way: str, repeats: int) -> float:
    """Median milliseconds of one forward over ``inputs`` (the model and lm_head of one row)."""
    from kunlun_runtime.models.forward import run_forward

    split = attention._split_mixed
    if way == "padded":
        attention._split_mixed = lambda *args: None  # the metadata without the split
    try:
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            run_forward(engine.model, engine.kv_cache, inputs, engine.device)
            samples.append((time.perf_counter() - start) * 1e3)
    finally:
        attention._split_mixed = split
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF-format model directory (default: embedded SmolLM2)")
    parser.add_argument("--quick", action="store_true", help="small shapes, one repetition (smoke test)")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=None, help="alternations (default 5)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from kunlun_runtime import LLM

    options = {
        "kv_cache_memory": "64MiB" if args.quick else "512MiB",
        "max_model_len": 256 if args.quick else 2048,
    }
    if args.dtype:
        options["dtype"] = args.dtype
    engine = LLM(args.model, **options).engine
    # (decodes, their context, chunk, tokens before the chunk)
    cases = [(2, 32, 8, 16)] if args.quick else [(4, 300, 64, 0), (8, 600, 128, 512), (16, 400, 256, 1024)]
    reps, repeats = (1, 1) if args.quick else (args.reps or 5, 3)
    results = []
    for decodes, context, chunk, start in cases:
        inputs = step_inputs(engine, decodes, context, chunk, start)
        time_step(engine, inputs, "split", 1)  # warm-up
        samples = {way: [] for way in WAYS}
        for rep in range(reps):
            for way in WAYS if rep % 2 == 0 else reversed(WAYS):
                samples[way].append(time_step(engine, inputs, way, repeats))
        row = {"decodes": decodes, "decode_context": context, "chunk": chunk, "chunk_start": start}
        row.update({f"{way}_ms": statistics.median(samples[way]) for way in WAYS})
        row["speedup"] = row["padded_ms"] / row["split_ms"]
        results.append(row)
    print(f"one mixed step, {engine.dtype}, threads={args.threads}, median of {reps} alternations")
    print(
        f"{'decodes':>8}{'context':>9}{'chunk':>7}{'after':>7}{'split ms':>10}{'padded ms':>11}{'speedup':>9}"
    )
    for row in results:
        print(
            f"{row['decodes']:>8}{row['decode_context']:>9}{row['chunk']:>7}{row['chunk_start']:>7}"
            f"{row['split_ms']:>10.1f}{row['padded_ms']:>11.1f}{row['speedup']:>8.2f}x"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

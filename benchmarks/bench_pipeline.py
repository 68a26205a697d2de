"""Pipeline benchmark: what a stage boundary costs per step, and what micro-batching gains.

Three engines on the same model and requests, interleaved in one run (``--reps`` rounds, medians):

- ``one``: one process (P=1) on the threads one pipeline rank gets;
- ``staged``: P=2 stages in two processes, one micro-batch per step: the stages run in turn, so
  ``staged - one`` per step is the cost of the stage boundary (the hidden states sent, the
  logits sent back, the step's plan broadcast), with the same arithmetic;
- ``overlapped``: the same P=2 group with two micro-batches per step, stage 1 working on the
  first while stage 0 works on the second; ``staged / overlapped`` is the micro-batching gain.

Both P=2 variants are the same engine (``runner.micro_batches`` switched between rounds); a step
is split only into micro-batches of at least ``--min-micro-batch-tokens`` tokens (default: the
engine's ``MIN_MICRO_BATCH_TOKENS``; 1 measures the split at every batch size). Each round adds
``--batch`` requests of ``--prompt-len`` tokens and times every decode step after their prefills.
Every rank gets the node's CPUs over its ranks (one thread each on 2 cores), so ``one`` runs on
that many threads too; ``one_all_cores`` is the same process on every CPU, what one node would
run without pipeline parallelism. Only ratios from one run mean anything.

    .venv/bin/python benchmarks/bench_pipeline.py                       # embedded SmolLM2
    .venv/bin/python benchmarks/bench_pipeline.py --quick --model DIR   # smoke run (the test suite)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from kunlun_runtime import LLM, SamplingParams
from kunlun_runtime.engine.llm_engine import LLMEngine
from kunlun_runtime.parallel import pipeline


def decode_step_seconds(engine: LLMEngine, batch: int, prompt_len: int, new_tokens: int, tag: str) -> float:
    """Median decode-step time of ``batch`` sequences (after every prefill is done)."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    vocab = min(engine.model_config.vocab_size, 1000)
    for index in range(batch):
        prompt = [(7 * index + 13 * position) % (vocab - 10) + 10 for position in range(prompt_len)]
        engine.add_request(f"{tag}-{index}", prompt, params)
    times: list[float] = []
    while engine.has_unfinished_requests():
        decoding = not engine.scheduler.waiting and all(
            request.num_computed_tokens >= len(request.prompt_token_ids)
            for request in engine.scheduler.running
        )
        began = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="HF-format model directory (default: embedded SmolLM2)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batches", default="4,16,32", help="decode batch sizes")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--min-micro-batch-tokens",
        type=int,
        default=pipeline.MIN_MICRO_BATCH_TOKENS,
        help="the split's floor",
    )
    parser.add_argument("--quick", action="store_true", help="one small round (the test suite's smoke run)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    pipeline.MIN_MICRO_BATCH_TOKENS = args.min_micro_batch_tokens  # read by plan_step in this process
    reps, new_tokens = args.reps, args.new_tokens
    if args.quick:
        batches, reps, new_tokens = [4], 1, 4
    options = {"dtype": args.dtype, "kv_cache_memory": "256MiB", "max_model_len": 512, "max_num_seqs": 64}
    staged = LLM(args.model, pipeline_parallel_size=2, **options).engine
    threads = torch.get_num_threads()  # what the leader rank got: the node's CPUs over its ranks
    one = LLM(args.model, **options).engine
    all_cores = len(os.sched_getaffinity(0))
    runs = {"one": (one, 1), "staged": (staged, 1), "overlapped": (staged, 2), "one_all_cores": (one, 1)}
    results: dict[str, dict] = {
        "threads_per_rank": threads,
        "all_cores": all_cores,
        "min_micro_batch_tokens": pipeline.MIN_MICRO_BATCH_TOKENS,
        "batches": {},
    }
    try:
        for name, (engine, micro) in runs.items():  # warm-up: kernels, allocator, first compile
            engine.runner.micro_batches = micro
            decode_step_seconds(engine, 2, 8, 2, f"warm-{name}")
        for batch in batches:
            samples: dict[str, list[float]] = {name: [] for name in runs}
            for rep in range(reps):
                for name, (engine, micro) in runs.items():
                    engine.runner.micro_batches = micro
                    samples[name].append(
                        decode_step_seconds(
                            engine, batch, args.prompt_len, new_tokens, f"{name}-{batch}-{rep}"
                        )
                    )
            median = {name: statistics.median(values) for name, values in samples.items()}
            row = {
                **{f"{name}_step_ms": 1000 * value for name, value in median.items()},
                "boundary_ms_per_step": 1000 * (median["staged"] - median["one"]),
                "micro_batching_gain": median["staged"] / median["overlapped"],
                "overlapped_vs_one": median["one"] / median["overlapped"],
                "overlapped_vs_one_all_cores": median["one_all_cores"] / median["overlapped"],
            }
            results["batches"][str(batch)] = row
            print(
                f"batch {batch:>3}: one {row['one_step_ms']:7.2f} ms  staged {row['staged_step_ms']:7.2f} ms  "
                f"overlapped {row['overlapped_step_ms']:7.2f} ms | boundary {row['boundary_ms_per_step']:+6.2f} "
                f"ms/step, micro-batching ×{row['micro_batching_gain']:.2f}, "
                f"overlapped vs one process ×{row['overlapped_vs_one']:.2f} "
                f"(on all {all_cores} cores: {row['one_all_cores_step_ms']:.2f} ms, "
                f"×{row['overlapped_vs_one_all_cores']:.2f})",
                flush=True,
            )
    finally:
        staged.close()
    print(f"threads per rank: {threads}")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Overlap benchmark: does doing a step's host work while the next step's forward runs pay off on
this platform? Side by side, in one process, on the same engine.

- ``sequential``: ``LLMEngine.step()`` as the engine runs it: schedule → forward → sample → per
  request detokenize, stop checks and output.
- ``overlapped``: the forward of step N runs on a worker thread (our kernels and ATen release the
  GIL) while the main thread does step N-1's per-request host work (detokenize, stop checks,
  output); the sampled token ids are recorded at once, so step N+1 can be scheduled right after.
  These are the pieces of ``LLMEngine.step()`` itself, reordered the way an overlapping engine
  would run them.

Decode-only batches (``--batch`` requests, 128-token prompts, ``ignore_eos``); each measurement
block starts fresh requests, and the two modes alternate ``--reps`` times. Prints medians of
milliseconds per step and overlapped/sequential throughput.

    .venv/bin/python benchmarks/bench_overlap.py                        # SmolLM2, batch 1 and 8
    .venv/bin/python benchmarks/bench_overlap.py --quick --model DIR    # smoke run (the test suite)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

MODES = ("sequential", "overlapped")


def start_requests(engine, batch: int, prompt_tokens: int, tag: str, seed: int) -> list[str]:
    """Add ``batch`` requests that never stop on their own and run their prefill."""
    from kunlun_runtime import SamplingParams

    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    # As many tokens as the context leaves: never stopping on their own within the run.
    params = SamplingParams(temperature=0, max_tokens=engine.max_model_len - prompt_tokens, ignore_eos=True)
    ids = [f"{tag}-{index}" for index in range(batch)]
    for request_id in ids:
        prompt = [rng.randrange(min(100, vocab - 1), vocab) for _ in range(prompt_tokens)]
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    while any(not engine._tracked[r].request.output_token_ids for r in ids):
        engine.step()
    return ids


def sequential_steps(engine, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return time.perf_counter() - start


def overlapped_steps(engine, steps: int, pool: ThreadPoolExecutor) -> float:
    """``steps`` decode steps with each step's per-request host work done during the next forward:
    the pieces of ``LLMEngine.step()``, reordered."""
    pending: list[tuple[object, int]] = []  # (tracked request, token id) still to be emitted
    start = time.perf_counter()
    for _ in range(steps):
        sched = engine.scheduler.schedule()
        began = engine._start_step(sched)
        forward = pool.submit(engine.runner.execute, sched, engine._block_tables(sched))
        for tracked, token_id in pending:  # the host work that overlaps the forward
            emit(engine, tracked, token_id)
        sampled = engine._finish_step(sched, forward.result(), began, None)  # no constrained requests
        now = time.monotonic()
        pending = []
        for tracked, tokens in sampled:  # one token each: no speculative decoding here
            ((token_id, logprob),) = tokens
            engine._record_token(tracked, token_id, logprob, now)  # the next schedule needs only this
            pending.append((tracked, token_id))
    for tracked, token_id in pending:
        emit(engine, tracked, token_id)
    return time.perf_counter() - start


def emit(engine, tracked, token_id: int) -> None:
    """Detokenize, check stops and build the output of a recorded token. The benchmark's requests
    never stop (``ignore_eos``, no length limit in reach), so a stop means the measurement is wrong."""
    if engine._emit(tracked, token_id).finished:
        raise RuntimeError(f"{tracked.request.request_id} stopped during the overlap benchmark")


def measure(engine, mode: str, batch: int, steps: int, tag: str, pool: ThreadPoolExecutor) -> float:
    """Milliseconds per decode step of ``batch`` fresh requests under ``mode``."""
    ids = start_requests(engine, batch, 128, tag, seed=zlib.crc32(tag.encode()))
    try:
        seconds = (
            sequential_steps(engine, steps) if mode == "sequential" else overlapped_steps(engine, steps, pool)
        )
    finally:
        for request_id in ids:
            engine.abort_request(request_id)
    assert engine.block_pool.num_free == engine.block_pool.num_blocks, "a KV block leaked"
    return seconds / steps * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF-format model directory (default: embedded SmolLM2)")
    parser.add_argument("--quick", action="store_true", help="few steps, one repetition (smoke test)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=None, help="decode steps per block (default 64)")
    parser.add_argument("--reps", type=int, default=None, help="alternations (default 5)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    steps = args.steps or (4 if args.quick else 64)
    reps = args.reps or (1 if args.quick else 5)

    from kunlun_runtime import LLM

    options = {"kv_cache_memory": "256MiB"}
    if args.dtype:
        options["dtype"] = args.dtype
    engine = LLM(args.model, **options).engine
    results: dict[str, dict] = {}
    with ThreadPoolExecutor(max_workers=1) as pool:
        for batch in args.batch:
            measure(engine, "overlapped", batch, steps, f"warmup-{batch}", pool)
            samples: dict[str, list[float]] = {mode: [] for mode in MODES}
            for rep in range(reps):
                order = MODES if rep % 2 == 0 else tuple(reversed(MODES))
                for mode in order:
                    samples[mode].append(measure(engine, mode, batch, steps, f"{mode}-{batch}-{rep}", pool))
            row = {f"{mode}_ms_per_step": statistics.median(samples[mode]) for mode in MODES}
            row["overlapped_vs_sequential"] = row["sequential_ms_per_step"] / row["overlapped_ms_per_step"]
            row["samples_ms"] = samples
            results[f"batch{batch}"] = row
    print(f"decode steps, {steps} per block × {reps} alternations, threads={args.threads}")
    print(f"{'batch':<8}{'sequential ms':>15}{'overlapped ms':>15}{'overlapped speed':>18}")
    for name, row in results.items():
        print(
            f"{name:<8}{row['sequential_ms_per_step']:>15.2f}{row['overlapped_ms_per_step']:>15.2f}"
            f"{row['overlapped_vs_sequential']:>17.2f}x"
        )
    if args.json is not None:
        args.json.write_text(
            json.dumps({"steps": steps, "reps": reps, "threads": args.threads, **results}, indent=2)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

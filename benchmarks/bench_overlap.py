"""Overlap benchmark (issue item 7, seed §3.2): does doing a step's host work while the next
step's forward runs pay off on this platform? Side by side, in one process, on the same engine.

- ``sequential``: ``LLMEngine.step()`` as the engine runs it: schedule → forward → sample → per
  request detokenize, stop checks and output.
- ``overlapped``: the forward of step N runs on a worker thread (our kernels and ATen release the
  GIL) while the main thread does step N-1's per-request host work (detokenize, stop checks,
  output); the sampled token ids are appended at once, so step N+1 can be scheduled right after.
  This is the engine's real work split the way an overlapping engine would split it.

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
    params = SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True)
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
    """``steps`` decode steps with each step's per-request host work done during the next forward."""
    pending: list[tuple[object, int]] = []  # (tracked request, token id) still to be processed
    start = time.perf_counter()
    for _ in range(steps):
        sched = engine.scheduler.schedule()
        tables = {s.request.request_id: engine.kv.block_ids(s.request.request_id) for s in sched.scheduled}
        began = time.monotonic()
        forward = pool.submit(engine.runner.execute, sched, tables)
        for tracked, token_id in pending:  # the host work that overlaps the forward
            finish_host_work(engine, tracked, token_id)
        logits = forward.result()
        engine.scheduler.observe_step(sched, time.monotonic() - began)
        for item in sched.scheduled:
            item.request.num_computed_tokens += item.num_new_tokens
            engine.kv.cache_computed_blocks(item.request)
        requests = [engine._tracked[rid].request for rid in logits.sample_request_ids]
        sampled = engine.sampler.sample(logits.sample_logits, requests)
        pending = []
        for request, (token_id, _logprob) in zip(requests, sampled, strict=True):
            request.output_token_ids.append(token_id)  # the next schedule needs only the id
            engine.num_generation_tokens_total += 1
            pending.append((engine._tracked[request.request_id], token_id))
    for tracked, token_id in pending:
        finish_host_work(engine, tracked, token_id)
    return time.perf_counter() - start


def finish_host_work(engine, tracked, token_id: int) -> None:
    """What ``LLMEngine._append_token`` does after appending the id: detokenize, check stops,
    build the output. The benchmark's requests never stop (``ignore_eos``, no length limit in
    reach), so a stop here means the measurement is wrong."""
    tracked.detokenizer.add(token_id)
    if engine._check_stop(tracked, token_id) is not None:
        raise RuntimeError(f"{tracked.request.request_id} stopped during the overlap benchmark")
    engine._output(tracked, new_token_ids=[token_id])


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

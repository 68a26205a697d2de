"""Plain decode at batches past 16: our kernels up to 64 rows against the earlier limits.

Until 3 Dec 2026 our linears and the one-call decode layer stack took at most 16 rows; a decode
step of more went layer by layer through oneDNN's GEMM. This runs closed batches of ``--batches``
prompts (greedy, ``--max-tokens`` each, ~350 tokens of prompt) on two engines over the same model
in one process, alternating which goes first: ``ours`` as shipped, and ``limited``, whose decode
steps of more than ``--limit`` rows go the earlier way (its linears' and layer stack's row limit
set back). Reports decode tok/s (medians of ``--repeats``) and the median of the per-repetition
ratios.

    .venv/bin/python benchmarks/bench_decode_batches.py                     # --batches 16,24,32
    .venv/bin/python benchmarks/bench_decode_batches.py --batches 32,48,64 --limit 32
    .venv/bin/python benchmarks/bench_decode_batches.py --quick --model DIR  # smoke run
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys

import bench_speculative  # benchmarks/, beside this script
import engine_batches

from kunlun_runtime import LLM, SamplingParams
from kunlun_runtime.layers.linear import NativeLinear


def limit_rows(llm: LLM, rows: int) -> None:
    """Decode steps of more than ``rows`` sequences leave our kernels, as before they took more."""
    engine = llm.engine
    for module in engine.model.modules():
        if isinstance(module, NativeLinear):
            module.max_rows = rows
    engine.model.decode_max_rows = rows
    engine.scheduler.cost.pass_rows = rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="HF-format model directory (default: the embedded SmolLM2)")
    parser.add_argument(
        "--batches", type=lambda text: [int(v) for v in text.split(",")], default=[16, 24, 32]
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--limit", type=int, default=16, help="the baseline's rows per decode step on our kernels"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="short prompts and outputs: checks that it runs")
    parser.add_argument("--json", help="write the results here too")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    options = {"dtype": "auto", "max_num_batched_tokens": 16384, "enable_prefix_caching": False}
    engines = {"ours": LLM(args.model, **options), "limited": LLM(args.model, **options)}
    if not engines["ours"].engine.model.native_kernels:
        print("needs our CPU kernels (a BF16 model on an AVX2 or AVX-512 CPU)", file=sys.stderr)
        return 2
    limit_rows(engines["limited"], args.limit)
    max_tokens = 4 if args.quick else args.max_tokens
    scale = 0.025 if args.quick else 0.3
    prompts = {
        batch: bench_speculative.prompt_ids(engines["ours"], bench_speculative.copy_tasks(batch, scale))
        for batch in args.batches
    }
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    salts = itertools.count()
    for llm in engines.values():  # warm-up: kernels, allocator
        engine_batches.run_batch(llm.engine, prompts[args.batches[0]][:2], params, cache_salt="warm-up")
    rates: dict[tuple[int, str], list[float]] = {}
    for repeat in range(args.repeats):
        for batch in args.batches:
            names = list(engines) if repeat % 2 == 0 else list(engines)[::-1]
            for name in names:
                timing = engine_batches.run_batch(
                    engines[name].engine, prompts[batch], params, cache_salt=f"run-{next(salts)}"
                )
                rates.setdefault((batch, name), []).append(timing.decode_tok_s)
    report = {}
    print(
        f"decode tok/s, medians of {args.repeats}; ratio: median of ours / limit {args.limit} per repetition"
    )
    for batch in args.batches:
        ours, earlier = rates[(batch, "ours")], rates[(batch, "limited")]
        ratio = statistics.median(a / b for a, b in zip(ours, earlier, strict=True))
        row = {"ours": statistics.median(ours), "limited": statistics.median(earlier), "ratio": ratio}
        report[str(batch)] = row
        print(f"batch {batch:3d}: ours {row['ours']:7.1f}, limited {row['limited']:7.1f} tok/s, {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
    for llm in engines.values():
        llm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

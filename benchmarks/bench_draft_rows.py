"""What the rows of a decode step cost in our AVX-512 kernels: the price of a speculative draft.

Two measurements on the embedded model's shapes (SmolLM2-135M: hidden 576, MLP 1,536, 9 query
and 3 KV heads of 64, 30 layers, a 49,152-token LM head), each against a baseline in the same run,
interleaved, medians of ``--repeats``:

- **linears**: one decode step's linears (30 layers, each with its own weights so they stream
  from memory as in a model, and the LM head) for M rows in one ``linear_bf16`` call, against the
  same rows in calls of at most 8 (each call reads the weights again, as the kernel did for more
  than 8 rows before it served 9-16, and then 17-32, in one pass);
- **attention**: ``decode_attention`` over 30 layers for one decode row and its drafts (rows at
  consecutive positions over one block table, which share one read of their keys), against the
  same rows as separate sequences of the same length (each reads its own keys).

Reported: milliseconds per step, the ratio baseline / ours, and the added cost per row over one
row. Needs the AVX-512 tier (BF16 activations).

    .venv/bin/python benchmarks/bench_draft_rows.py                  # --context 1300 --repeats 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from kunlun_runtime.layers import cpu_kernels

HIDDEN, INTERMEDIATE, VOCAB, LAYERS = 576, 1536, 49152, 30
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
# (out, in) of one layer's linears: fused qkv, o, fused gate/up, down
LAYER_SHAPES = [
    (HIDDEN + 2 * KV_HEADS * HEAD_DIM, HIDDEN),
    (HIDDEN, HIDDEN),
    (2 * INTERMEDIATE, HIDDEN),
    (HIDDEN, INTERMEDIATE),
]


def _weights(generator: torch.Generator, layers: int) -> list[torch.Tensor]:
    weights = [
        torch.randn(n, k, generator=generator).bfloat16() for _ in range(layers) for n, k in LAYER_SHAPES
    ]
    return [*weights, torch.randn(VOCAB, HIDDEN, generator=generator).bfloat16()]


def _linears(weights: list[torch.Tensor], inputs: dict[int, torch.Tensor], rows_per_call: int) -> float:
    start = time.perf_counter()
    for w in weights:
        x = inputs[w.shape[1]]
        for first in range(0, x.shape[0], rows_per_call):
            cpu_kernels.linear_bf16(x[first : first + rows_per_call], w, None)
    return time.perf_counter() - start


def _attention_inputs(rows: int, context: int, grouped: bool, generator: torch.Generator) -> dict:
    blocks = (context + rows) // BLOCK + 2
    table = torch.randperm(blocks, generator=generator)
    lengths = [context + r for r in range(rows)] if grouped else [context] * rows
    return {
        "q": torch.randn(rows, HEADS, HEAD_DIM, generator=generator).bfloat16(),
        "k": torch.randn(rows, KV_HEADS, HEAD_DIM, generator=generator).bfloat16(),
        "v": torch.randn(rows, KV_HEADS, HEAD_DIM, generator=generator).bfloat16(),
        "cos": torch.randn(rows, HEAD_DIM, generator=generator).bfloat16(),
        "sin": torch.randn(rows, HEAD_DIM, generator=generator).bfloat16(),
        "tables": table.unsqueeze(0).repeat(rows, 1).contiguous(),
        "lengths": torch.tensor(lengths),
    }


def _attention(caches: list[tuple[torch.Tensor, torch.Tensor]], inputs: dict) -> float:
    start = time.perf_counter()
    for k_blocks, v_blocks in caches:
        cpu_kernels.decode_attention(
            inputs["q"], inputs["k"], inputs["v"], inputs["cos"], inputs["sin"], k_blocks, v_blocks,
            inputs["tables"], inputs["lengths"], HEAD_DIM**-0.5, 0,
        )  # fmt: skip
    return time.perf_counter() - start


def measure(rows_list: list[int], context: int, repeats: int, layers: int = LAYERS) -> dict:
    generator = torch.Generator().manual_seed(0)
    weights = _weights(generator, layers)
    blocks = (context + max(rows_list)) // BLOCK + 2
    caches = [
        (
            torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=generator).bfloat16(),
            torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=generator).bfloat16(),
        )
        for _ in range(layers)
    ]
    samples: dict[tuple[str, int], list[float]] = {}
    cases = {}
    for rows in rows_list:
        inputs = {k: torch.randn(rows, k, generator=generator).bfloat16() for k in (HIDDEN, INTERMEDIATE)}
        cases[rows] = (
            inputs,
            _attention_inputs(rows, context, True, generator),
            _attention_inputs(rows, context, False, generator),
        )
    for _ in range(repeats):  # interleaved: every case once per repetition
        for rows, (inputs, grouped, separate) in cases.items():
            samples.setdefault(("linears", rows), []).append(_linears(weights, inputs, cpu_kernels.MAX_ROWS))
            samples.setdefault(("linears_passes_of_8", rows), []).append(_linears(weights, inputs, 8))
            samples.setdefault(("attention", rows), []).append(_attention(caches, grouped))
            samples.setdefault(("attention_separate", rows), []).append(_attention(caches, separate))
    return {f"{name}/{rows}": statistics.median(values) * 1e3 for (name, rows), values in samples.items()}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rows", type=lambda text: [int(v) for v in text.split(",")], default=[1, 4, 8, 12, 16, 24, 32]
    )
    parser.add_argument("--context", type=int, default=1300, help="keys before the first row")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--layers", type=int, default=LAYERS, help="decoder layers (a smoke run takes fewer)")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    parser.add_argument("--json", help="write the results here too")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not cpu_kernels.load(torch.bfloat16):
        print(f"needs the AVX-512 kernels: {cpu_kernels.unavailable_reason(torch.bfloat16)}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    ms = measure(args.rows, args.context, args.repeats, args.layers)
    first = min(args.rows)
    print(f"{torch.get_num_threads()} threads, {args.context} keys of context, medians of {args.repeats}")
    print("rows | linears ms (passes of 8 ms, ratio) | +ms/row | attention ms (separate ms, ratio) | +ms/row")
    for rows in args.rows:
        lin, lin8 = ms[f"linears/{rows}"], ms[f"linears_passes_of_8/{rows}"]
        att, sep = ms[f"attention/{rows}"], ms[f"attention_separate/{rows}"]
        extra = max(rows - first, 1)
        print(
            f"{rows:4d} | {lin:7.2f} ({lin8:7.2f}, {lin8 / lin:4.2f}x) | {(lin - ms[f'linears/{first}']) / extra:5.2f} "
            f"| {att:7.2f} ({sep:7.2f}, {sep / att:4.2f}x) | {(att - ms[f'attention/{first}']) / extra:5.2f}"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(
                {"threads": torch.get_num_threads(), "context": args.context, "ms": ms}, handle, indent=2
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""KV block placement: aligned-only versus aligned + skewed, on long-context decode attention.

With block sizes that are a multiple of the cache's set period, every block starts in the same
cache set and long-context decode thrashes (``kv/block_layout.py``). This benchmark builds two KV
caches of SmolLM2's shape (30 layers, 3 KV heads × 64, BF16) — one skewed, one aligned only — fills
``--context`` tokens per sequence with the blocks of all sequences interleaved (as a busy server
allocates them), and times decode steps of the paged attention of every layer, interleaving the two
layouts, ``--reps`` times. It prints medians and the ratio, whatever its sign. ``--kernel native``
(the default where our CPU kernels load) times the decode-attention kernel the engine runs, which
reads the blocks in place; ``--kernel torch`` the gather + SDPA path.

    .venv/bin/python benchmarks/bench_kv_layout.py                 # 8192-token context, batch 4
    .venv/bin/python benchmarks/bench_kv_layout.py --quick         # smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kunlun_runtime.kv.cache import KVCache, KVCacheSpec
from kunlun_runtime.layers import cpu_kernels
from kunlun_runtime.layers.attention import build_attention_metadata, paged_attention
from kunlun_runtime.platforms.cpu import CpuPlatform


def make_cache(args: argparse.Namespace, skew: bool, num_blocks: int) -> KVCache:
    spec = KVCacheSpec(args.layers, args.kv_heads, args.head_dim, args.block_size, torch.bfloat16)
    platform = CpuPlatform()
    cache = KVCache(
        spec,
        num_blocks,
        torch.device("cpu"),
        cache_line_bytes=platform.cache_line_bytes,
        cache_num_sets=platform.cache_num_sets,
        skew=skew,
    )
    for layer in range(args.layers):
        cache.k_blocks[layer].normal_()
        cache.v_blocks[layer].normal_()
    return cache


def decode_step_seconds(cache: KVCache, args: argparse.Namespace, tables: list[list[int]]) -> float:
    batch = len(tables)
    meta = build_attention_metadata(
        [1] * batch, [args.context] * batch, tables, args.block_size, torch.device("cpu")
    )
    q = torch.randn(batch, args.heads, args.head_dim, dtype=torch.bfloat16)
    k = torch.randn(batch, args.kv_heads, args.head_dim, dtype=torch.bfloat16)
    cos = torch.ones(batch, args.head_dim, dtype=torch.bfloat16)
    sin = torch.zeros(batch, args.head_dim, dtype=torch.bfloat16)
    scale = args.head_dim**-0.5
    start = time.perf_counter()
    for layer in range(args.layers):
        k_blocks, v_blocks = cache.k_blocks[layer], cache.v_blocks[layer]
        if args.kernel == "native":
            cpu_kernels.decode_attention(
                q, k, k, cos, sin, k_blocks, v_blocks, meta.block_tables, meta.context_lens, scale, 0
            )
        else:
            paged_attention(q, k, k, k_blocks, v_blocks, meta, scale)
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5, help="decode steps per repetition")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--kernel", choices=("native", "torch"), default=None, help="default: native where it loads"
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    if args.quick:
        args.context, args.batch, args.layers, args.reps, args.steps = 256, 2, 2, 2, 1
    if args.kernel is None:
        args.kernel = "native" if cpu_kernels.load() else "torch"
    torch.set_num_threads(args.threads)
    blocks_per_seq = -(-args.context // args.block_size)
    num_blocks = blocks_per_seq * args.batch
    # Interleave the sequences' blocks, as concurrent requests get them from the free list.
    tables = [[b * args.batch + s for b in range(blocks_per_seq)] for s in range(args.batch)]
    caches = {
        "aligned+skewed": make_cache(args, True, num_blocks),
        "aligned only": make_cache(args, False, num_blocks),
    }
    times: dict[str, list[float]] = {name: [] for name in caches}
    for cache in caches.values():  # warm-up: first touches and allocator growth stay out of the timing
        decode_step_seconds(cache, args, tables)
    for _ in range(args.reps):
        for name, cache in caches.items():
            times[name].append(
                sum(decode_step_seconds(cache, args, tables) for _ in range(args.steps)) / args.steps
            )
    result = {
        "kernel": args.kernel,
        "context_tokens": args.context,
        "batch": args.batch,
        "layers": args.layers,
        "stride_bytes": {name: cache.layout.stride_bytes for name, cache in caches.items()},
        "median_step_ms": {name: 1000 * statistics.median(values) for name, values in times.items()},
    }
    result["skewed_speedup"] = (
        result["median_step_ms"]["aligned only"] / result["median_step_ms"]["aligned+skewed"]
    )
    print(
        f"decode attention ({args.kernel}), {args.layers} layers, batch {args.batch}, {args.context} tokens of KV each "
        f"({num_blocks} blocks of {args.block_size}):"
    )
    for name, value in result["median_step_ms"].items():
        print(f"  {name:<16} stride {result['stride_bytes'][name]:>6} B   median {value:8.2f} ms/step")
    print(f"  aligned+skewed vs aligned only: {result['skewed_speedup']:.3f}x")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Our AVX-512 linear kernels at another commit against this tree's, side by side in one process.

A kernel change is judged against the kernel it replaces on the same machine state: this builds
the kernel sources of ``--base`` (``git archive``, compiled with this tree's flags into the op
namespace ``kunlun_base``) beside this tree's library, alternates the two inside every repetition
and reports medians and the ratio base / tree, with a check that both give the same bits (or a
count of the outputs that differ, for a change that is meant to alter them):

1. ``cached``: each projection of the model's decoder layers and its LM head alone, called again
   and again, so its weight stays in cache (an LM head larger than the L3, as SmolLM2's 57 MB,
   still streams from memory): the kernels' arithmetic, at each of ``--rows``;
2. ``step``: a decode step's linears, every layer its own weights and the LM head (as in a model,
   they stream from memory), at each of ``--rows``.

    .venv/bin/python benchmarks/bench_kernel_ab.py --base HEAD~1       # ~2 minutes on 2 cores
    .venv/bin/python benchmarks/bench_kernel_ab.py --base 23558ac --rows 1 8 16

Needs the AVX-512 tier (BF16 activations); elsewhere it exits with status 2.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch
from bench_engine import linear_shapes  # benchmarks/, beside this

from kunlun_runtime.layers import cpu_kernels, kernel_build
from kunlun_runtime.models.model_config import load_model_config
from kunlun_runtime.models.model_dir import resolve_model_dir
from kunlun_runtime.platforms.cpu_features import IsaTier, cpu_capabilities

REPO = Path(__file__).resolve().parents[1]
BASE_NAMESPACE = "kunlun_base"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD", help="the commit whose kernels are the baseline")
    parser.add_argument("--model", default=None, help="HF-format directory (default: embedded SmolLM2)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 24])
    parser.add_argument("--reps", type=int, default=9, help="repetitions of each case, alternating")
    parser.add_argument("--calls", type=int, default=20, help="calls per repetition of a cached case")
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args(argv)


def build_base(revision: str):
    """The AVX-512 kernel library of ``revision``, loaded as ``torch.ops.kunlun_base``."""
    resolved = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}"],
        capture_output=True,
        text=True,
    )
    if resolved.returncode != 0:
        raise ValueError(f"--base {revision!r} is not a commit of {REPO}")
    commit = resolved.stdout.strip()
    csrc = cpu_kernels.CSRC.relative_to(REPO)
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", commit, str(csrc)], capture_output=True, check=True
    ).stdout
    tier = cpu_kernels.TIERS[IsaTier.AVX512]
    flags = [*tier.compile_flags, f"-DKUNLUN_OPS={BASE_NAMESPACE}"]
    with tempfile.TemporaryDirectory(prefix="kernel-ab-") as tmp:  # the sources, until compiled
        root = Path(tmp)
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(root, filter="data")
        sources = [str(root / csrc / source.relative_to(cpu_kernels.CSRC)) for source in tier.sources]
        kernel_build.compile_and_load(f"{BASE_NAMESPACE}_{commit[:12]}", sources, flags)
    return commit, getattr(torch.ops, BASE_NAMESPACE)


def _alternate(reps: int, timed) -> dict[str, float]:
    """Median seconds of ``timed(side)`` for both sides, which goes first alternating."""
    samples: dict[str, list[float]] = {"base": [], "tree": []}
    for rep in range(reps):
        for side in ("base", "tree") if rep % 2 == 0 else ("tree", "base"):
            samples[side].append(timed(side))
    return {side: statistics.median(values) for side, values in samples.items()}


def _differing(base_out: torch.Tensor, tree_out: torch.Tensor) -> int:
    return int((base_out.view(torch.int16) != tree_out.view(torch.int16)).sum())


def _row(medians: dict[str, float], flops: float, differing: int) -> dict:
    return {
        "ms": {side: 1e3 * value for side, value in medians.items()},
        "gflops": {side: flops / value / 1e9 for side, value in medians.items()},
        "ratio": medians["base"] / medians["tree"],
        "differing_outputs": differing,
    }


def measure(args: argparse.Namespace, ops: dict, config) -> dict:
    shapes = [*linear_shapes(config), (config.vocab_size, config.hidden_size)]
    names = ["qkv", "o", "gate_up", "down", "lm_head"]  # linear_shapes' order
    generator = torch.Generator().manual_seed(0)

    def weight(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=generator) * 0.05).bfloat16()

    results: dict = {"cached": {}, "step": {}}
    for name, (n, k) in zip(names, shapes, strict=True):
        w = weight(n, k)
        for rows in args.rows:
            x = torch.randn(rows, k, generator=generator).bfloat16()

            def cached(side: str, x: torch.Tensor = x, w: torch.Tensor = w) -> float:
                start = time.perf_counter()
                for _ in range(args.calls):
                    ops[side].linear_bf16(x, w, None)
                return (time.perf_counter() - start) / args.calls

            medians = _alternate(args.reps, cached)
            differing = _differing(ops["base"].linear_bf16(x, w, None), ops["tree"].linear_bf16(x, w, None))
            results["cached"][f"{name} {n}x{k} x{rows}"] = _row(medians, 2 * rows * n * k, differing)
    layers = [weight(n, k) for _ in range(config.num_layers) for n, k in shapes[:-1]]
    step = [*layers, weight(*shapes[-1])]
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k, generator=generator).bfloat16() for _, k in shapes}

        def whole_step(side: str, inputs: dict[int, torch.Tensor] = inputs) -> float:
            start = time.perf_counter()
            for w in step:
                ops[side].linear_bf16(inputs[w.shape[1]], w, None)
            return time.perf_counter() - start

        medians = _alternate(args.reps, whole_step)
        differing = sum(
            _differing(
                ops["base"].linear_bf16(inputs[w.shape[1]], w, None),
                ops["tree"].linear_bf16(inputs[w.shape[1]], w, None),
            )
            for w in step
        )
        flops = 2 * rows * sum(w.numel() for w in step)
        results["step"][f"x{rows}"] = _row(medians, flops, differing)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cpu = cpu_capabilities()
    if cpu.tier not in (IsaTier.AVX512, IsaTier.AMX) or not cpu_kernels.load(torch.bfloat16):
        print(f"bench_kernel_ab: compares the AVX-512 tier's kernels; this CPU runs {cpu.tier.value}")
        return 2
    try:
        commit, base_ops = build_base(args.base)
    except ValueError as error:
        print(f"bench_kernel_ab: {error}", file=sys.stderr)
        return 2
    config = load_model_config(resolve_model_dir(args.model))  # the shapes only: no engine
    results = {
        "cpu": cpu.describe(),
        "base": commit,
        **measure(args, {"base": base_ops, "tree": torch.ops.kunlun_avx512}, config),
    }
    print(
        f"{results['cpu']}; base {commit[:12]} against this tree; medians of {args.reps}, ratio base / tree"
    )
    for kind in ("cached", "step"):
        for case, row in results[kind].items():
            ms, gf = row["ms"], row["gflops"]
            print(
                f"{kind:6s} {case:24s} base {ms['base']:8.3f} ms ({gf['base']:5.0f} GFLOPS)  "
                f"tree {ms['tree']:8.3f} ms ({gf['tree']:5.0f})  {row['ratio']:.3f}x  "
                f"{'same bits' if row['differing_outputs'] == 0 else str(row['differing_outputs']) + ' outputs differ'}"
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

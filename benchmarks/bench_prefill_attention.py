"""An AMX prefill-attention kernel (an experiment, not used by the runtime) against SDPA's flash kernel.

Prefill attention is a large share of a long prompt's TTFT, and SDPA's causal flash kernel, which
HF and our engine both call, runs it far below the tile units' peak.
``benchmarks/prefill_attention_amx.cpp`` is a flash-attention kernel on the AMX tile units with the
queries in the vector lanes. This builds it (with the runtime's ``amx_linear.cpp`` for the tile
helpers), checks it against an FP64 reference next to SDPA, and times both interleaved on the
model's heads, one call per layer.

    .venv/bin/python benchmarks/bench_prefill_attention.py              # SmolLM2's heads, 256 and 2,048 tokens
    .venv/bin/python benchmarks/bench_prefill_attention.py --quick      # smoke run (the test suite)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kunlun_runtime.layers import cpu_kernels
from kunlun_runtime.layers.attention import fresh_prompt_attention

HERE = Path(__file__).resolve().parent
CSRC = HERE.parent / "runtime" / "kunlun_runtime" / "layers" / "csrc"


def unavailable_reason() -> str | None:
    """Why the experiment cannot run here (no runtime CPU kernels, no AMX tiles), or None."""
    reason = cpu_kernels.unavailable_reason()
    if reason is not None:
        return f"the AMX experiment needs the runtime's CPU kernels: {reason}"
    flags = next(
        (line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), ""
    )
    if not {"amx_tile", "amx_bf16"} <= set(flags.split()):
        return "the AMX experiment needs a CPU with AMX tiles (amx_tile, amx_bf16)"
    return None


def build() -> None:
    """Compiles (or finds cached) the experiment's library and registers ``kunlun_experiment``."""
    from torch.utils import cpp_extension

    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(reason)
    cpp_extension.load(
        name="kunlun_prefill_attention_experiment",
        sources=[str(HERE / "prefill_attention_amx.cpp"), str(CSRC / "amx_linear.cpp")],
        extra_include_paths=[str(CSRC)],
        extra_cflags=cpu_kernels._COMPILE_FLAGS,
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention in FP64 from the same BF16 inputs, [T, H * D]."""
    T, H, D = q.shape
    group = H // k.shape[1]
    queries = q.double().transpose(0, 1)
    keys = k.double().transpose(0, 1).repeat_interleave(group, 0)
    values = v.double().transpose(0, 1).repeat_interleave(group, 0)
    scores = (queries @ keys.transpose(1, 2) * scale).masked_fill(
        torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")
    )
    return (torch.softmax(scores, -1) @ values).transpose(0, 1).reshape(T, H * D)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The engine's fresh-prompt attention (SDPA's causal flash kernel, as HF's prefill calls it)."""
    return fresh_prompt_attention(q, k, v, scale, enable_gqa=k.shape[1] != q.shape[1])


def amx(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.ops.kunlun_experiment.prefill_attention(q, k, v, scale)


def inputs(tokens: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(tokens, n, head_dim, generator=generator) * 2 for n in (heads, kv_heads))
    v = torch.randn(tokens, kv_heads, head_dim, generator=generator)
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def accuracy(shapes: list[tuple[int, int, int, int]]) -> list[dict]:
    """Max |error| of each kernel against the FP64 reference, per (tokens, heads, kv heads, D)."""
    rows = []
    for tokens, heads, kv_heads, head_dim in shapes:
        q, k, v = inputs(tokens, heads, kv_heads, head_dim)
        scale = head_dim**-0.5
        exact = reference(q, k, v, scale)
        rows.append(
            {
                "shape": [tokens, heads, kv_heads, head_dim],
                "amx_max_abs_err": (amx(q, k, v, scale).double() - exact).abs().max().item(),
                "sdpa_max_abs_err": (sdpa(q, k, v, scale).double() - exact).abs().max().item(),
            }
        )
    return rows


def timing(tokens: int, heads: int, kv_heads: int, head_dim: int, layers: int, reps: int) -> dict:
    """Seconds for ``layers`` calls of each kernel, interleaved, median of ``reps``."""
    q, k, v = inputs(tokens, heads, kv_heads, head_dim)
    scale = head_dim**-0.5
    kernels = {"amx": amx, "sdpa": sdpa}
    seconds: dict[str, list[float]] = {name: [] for name in kernels}
    for kernel in kernels.values():
        kernel(q, k, v, scale)
    for _ in range(reps):
        for name, kernel in kernels.items():
            start = time.perf_counter()
            for _ in range(layers):
                kernel(q, k, v, scale)
            seconds[name].append(time.perf_counter() - start)
    row = {f"{name}_s": statistics.median(values) for name, values in seconds.items()}
    row["amx_speedup"] = row["sdpa_s"] / row["amx_s"]
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes: checks that it builds, runs, agrees"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.layers, args.reps = [40], 2, 1
    torch.set_num_threads(args.threads)
    build()
    shapes = [(1, 9, 3, 64), (17, 9, 3, 64), (129, 4, 4, 64), (300, 8, 2, 128), (args.tokens[0], 9, 3, 64)]
    results = {"accuracy": accuracy(shapes), "timing": {}}
    for row in results["accuracy"]:
        print(
            f"shape (T, H, KVH, D) {tuple(row['shape'])}: max |error| vs FP64 amx {row['amx_max_abs_err']:.2e},"
            f" sdpa {row['sdpa_max_abs_err']:.2e}"
        )
    for tokens in args.tokens:
        row = timing(tokens, args.heads, args.kv_heads, args.head_dim, args.layers, args.reps)
        results["timing"][str(tokens)] = row
        print(
            f"{tokens} tokens, {args.layers} layers: amx {row['amx_s'] * 1e3:.1f} ms, sdpa {row['sdpa_s'] * 1e3:.1f} ms"
            f" -> amx speed-up {row['amx_speedup']:.2f}x"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Our kernels at another commit against this tree's, side by side in one process.

A kernel change is judged against the kernel it replaces on the same machine state: this builds
the kernel sources of ``--base`` (``git archive``, compiled with this tree's flags into the op
namespace ``kunlun_base``) beside this tree's library for the ISA tier in force, alternates the
two and reports the ratio base / tree, with a check that both give the same bits (or a count of
the outputs that differ, for a change that is meant to alter them):

1. ``cached``: each projection of the model's decoder layers and its LM head alone, called again
   and again, so its weight stays in cache (an LM head larger than the L3, as SmolLM2's 57 MB,
   still streams from memory): the kernels' arithmetic, at each of ``--rows``;
2. ``step``: a decode step's linears, every layer its own weights and the LM head (as in a model,
   they stream from memory), at each of ``--rows``;
3. ``attention`` (with ``--attention CONTEXTxROWS[xSEQUENCES] ...``): decode attention of
   SEQUENCES sequences (default 1) of ROWS rows each (a decode row and its drafts, sharing their
   keys) over CONTEXT keys of a BF16 cache, every layer its own cache, the model's heads;
4. ``engine`` (with ``--engine CONTEXTxBATCH ...``): the whole engine decoding, the two libraries
   swapped every step, so each base step sits between two tree steps and the machine's drift
   (busy neighbours move a 2-core VM's speed by 10-20 % within a minute) falls on both alike;
   mean milliseconds per decode step (every request past its prefill). Whole runs in separate
   processes differ by more than a kernel change moves them; swapped step by step, two runs of
   the same sources agree (docs/performance.md).

    .venv/bin/python benchmarks/bench_kernel_ab.py --base HEAD~1       # ~2 minutes on 2 cores
    .venv/bin/python benchmarks/bench_kernel_ab.py --base 23558ac --rows 1 8 16
    .venv/bin/python benchmarks/bench_kernel_ab.py --base HEAD~1 --rows 1 --engine 256x1 1024x1 256x8
    .venv/bin/python benchmarks/bench_kernel_ab.py --base HEAD~1 --rows 1 --attention 1500x1 1500x6 1500x2x8
    .venv/bin/python benchmarks/bench_kernel_ab.py --base HEAD~1 --weights int8 --rows 1 6   # linear_int8
    KUNLUN_CPU_ISA=avx2 .venv/bin/python benchmarks/bench_kernel_ab.py --base HEAD~1 --engine 256x1

Exits with status 2 where the tier's kernels do not build or ``--base`` is not a commit.
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

from kunlun_runtime import LLM, SamplingParams
from kunlun_runtime.layers import cpu_kernels, kernel_build
from kunlun_runtime.layers.linear import quantize_per_channel_int8
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
    parser.add_argument(
        "--weights",
        choices=("bf16", "int8"),
        default="bf16",
        help="the linears' weights: BF16, or INT8 with a scale per output channel (W8A16, linear_int8)",
    )
    parser.add_argument(
        "--engine",
        type=_engine_case,
        nargs="*",
        default=[],
        metavar="CONTEXTxBATCH",
        help="engine decode cases, e.g. 256x1 1024x8 (none: skip the engine)",
    )
    parser.add_argument(
        "--attention",
        type=_attention_case,
        nargs="*",
        default=[],
        metavar="CONTEXTxROWS[xSEQUENCES]",
        help="decode attention cases, e.g. 1500x1 1500x6 1500x2x8 (none: skip attention)",
    )
    parser.add_argument("--engine-tokens", type=int, default=256, help="tokens each request decodes")
    parser.add_argument("--engine-reps", type=int, default=3, help="batches per engine case")
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args(argv)


def _engine_case(text: str) -> tuple[int, int]:
    context, _, batch = text.partition("x")
    if not (context.isdigit() and batch.isdigit() and int(context) > 0 and int(batch) > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not CONTEXTxBATCH (e.g. 256x1)")
    return int(context), int(batch)


def _attention_case(text: str) -> tuple[int, int, int]:
    parts = text.split("x")
    if not (len(parts) in (2, 3) and all(part.isdigit() and int(part) > 0 for part in parts)):
        raise argparse.ArgumentTypeError(f"{text!r} is not CONTEXTxROWS[xSEQUENCES] (e.g. 1500x6, 1500x2x8)")
    context, rows, sequences = (*map(int, parts), 1)[:3]
    return context, rows, sequences


def _sources_at(csrc: Path, tier: cpu_kernels.KernelTier) -> list[Path]:
    """``tier``'s sources in a copy of ``csrc`` from another commit: the shared ones directly in
    csrc/, and every .cpp of the tier's own folders as that commit has them (a commit from before a
    source was split or added builds from the files it had)."""
    shared = [csrc / s.name for s in tier.sources if s.parent == cpu_kernels.CSRC]
    folders = sorted({s.parent.relative_to(cpu_kernels.CSRC) for s in tier.sources} - {Path(".")})
    return [*(path for folder in folders for path in sorted((csrc / folder).glob("*.cpp"))), *shared]


def build_base(revision: str, tier: cpu_kernels.KernelTier):
    """``tier``'s kernel library at ``revision``, loaded as ``torch.ops.kunlun_base``."""
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
    flags = [*tier.compile_flags, f"-DKUNLUN_OPS={BASE_NAMESPACE}"]
    with tempfile.TemporaryDirectory(prefix="kernel-ab-") as tmp:  # the sources, until compiled
        root = Path(tmp)
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(root, filter="data")
        sources = [str(source) for source in _sources_at(root / csrc, tier)]
        kernel_build.compile_and_load(f"{BASE_NAMESPACE}_{tier.namespace}_{commit[:12]}", sources, flags)
    return commit, getattr(torch.ops, BASE_NAMESPACE)


def _alternate(reps: int, timed) -> dict[str, float]:
    """Median seconds of ``timed(side)`` for both sides, which goes first alternating."""
    samples: dict[str, list[float]] = {"base": [], "tree": []}
    for rep in range(reps):
        for side in ("base", "tree") if rep % 2 == 0 else ("tree", "base"):
            samples[side].append(timed(side))
    return {side: statistics.median(values) for side, values in samples.items()}


def _differing(base_out: torch.Tensor, tree_out: torch.Tensor) -> int:
    bits = torch.int16 if base_out.element_size() == 2 else torch.int32
    return int((base_out.view(bits) != tree_out.view(bits)).sum())


def _row(medians: dict[str, float], flops: float, differing: int) -> dict:
    return {
        "ms": {side: 1e3 * value for side, value in medians.items()},
        "gflops": {side: flops / value / 1e9 for side, value in medians.items()},
        "ratio": medians["base"] / medians["tree"],
        "differing_outputs": differing,
    }


def measure(args: argparse.Namespace, ops: dict, config, activations: torch.dtype) -> dict:
    shapes = [*linear_shapes(config), (config.vocab_size, config.hidden_size)]
    names = ["qkv", "o", "gate_up", "down", "lm_head"]  # linear_shapes' order
    generator = torch.Generator().manual_seed(0)

    def weight(n: int, k: int) -> tuple[torch.Tensor, ...]:
        w = (torch.randn(n, k, generator=generator) * 0.05).bfloat16()
        return (w,) if args.weights == "bf16" else quantize_per_channel_int8(w)

    def linear(side: str, x: torch.Tensor, w: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if len(w) == 1:
            return ops[side].linear_bf16(x, w[0], None)
        return ops[side].linear_int8(x, *w, None)

    results: dict = {"cached": {}, "step": {}}
    for name, (n, k) in zip(names, shapes, strict=True):
        w = weight(n, k)
        for rows in args.rows:
            x = torch.randn(rows, k, generator=generator).to(activations)

            def cached(side: str, x: torch.Tensor = x, w: tuple[torch.Tensor, ...] = w) -> float:
                start = time.perf_counter()
                for _ in range(args.calls):
                    linear(side, x, w)
                return (time.perf_counter() - start) / args.calls

            medians = _alternate(args.reps, cached)
            differing = _differing(linear("base", x, w), linear("tree", x, w))
            results["cached"][f"{name} {n}x{k} x{rows}"] = _row(medians, 2 * rows * n * k, differing)
    layers = [weight(n, k) for _ in range(config.num_layers) for n, k in shapes[:-1]]
    step = [*layers, weight(*shapes[-1])]
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k, generator=generator).to(activations) for _, k in shapes}

        def whole_step(side: str, inputs: dict[int, torch.Tensor] = inputs) -> float:
            start = time.perf_counter()
            for w in step:
                linear(side, inputs[w[0].shape[1]], w)
            return time.perf_counter() - start

        medians = _alternate(args.reps, whole_step)
        differing = sum(
            _differing(linear("base", inputs[w[0].shape[1]], w), linear("tree", inputs[w[0].shape[1]], w))
            for w in step
        )
        flops = 2 * rows * sum(w[0].numel() for w in step)
        results["step"][f"x{rows}"] = _row(medians, flops, differing)
    return results


ATTENTION_BLOCK = 16  # tokens per KV block (the engine's default)


def measure_attention(args: argparse.Namespace, ops: dict, config, activations: torch.dtype) -> dict:
    """Median ms of a decode step's attention, every layer over its own cache, per --attention case:
    each sequence's rows are its decode row (the last position) and the drafts before it, their
    blocks in random order in a pool with as many blocks again free (as a busy cache has them)."""
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = config.num_heads, config.num_kv_heads, config.head_dim
    results = {}
    for context, rows, sequences in args.attention:
        blocks = -(-(context + rows) // ATTENTION_BLOCK)
        pool = 2 * blocks * sequences
        caches = [
            tuple(
                torch.randn(pool, ATTENTION_BLOCK, kv_heads, dim, generator=generator).bfloat16()
                for _ in range(2)
            )
            for _ in range(config.num_layers)
        ]
        order = torch.randperm(pool, generator=generator)
        tables = torch.cat(
            [order[s * blocks : (s + 1) * blocks].expand(rows, blocks) for s in range(sequences)]
        ).contiguous()
        lengths = torch.arange(context + 1, context + rows + 1, dtype=torch.long).repeat(sequences)
        total = rows * sequences
        q = torch.randn(total, heads, dim, generator=generator).to(activations)
        k, v = (torch.randn(total, kv_heads, dim, generator=generator).to(activations) for _ in range(2))
        cos, sin = (torch.randn(total, dim, generator=generator).to(activations) for _ in range(2))
        rotary = (q, k, v, cos, sin)

        def attend(side: str, layer: int, caches=caches, rotary=rotary, tables=tables, lengths=lengths):
            return ops[side].decode_attention(*rotary, *caches[layer], tables, lengths, dim**-0.5, 0)

        def step(side: str, attend=attend) -> float:
            start = time.perf_counter()
            for layer in range(config.num_layers):
                attend(side, layer)
            return time.perf_counter() - start

        medians = _alternate(args.reps, step)
        # Both write the new rows' K and V into the cache the same way: the second call rewrites
        # what the first wrote, so each reads the same keys.
        differing = _differing(attend("base", 0), attend("tree", 0))
        # Scores and P·V: 2 × 2 × D flops per query head and key.
        flops = 4 * dim * heads * config.num_layers * sequences * sum(range(context + 1, context + rows + 1))
        results[f"{context}x{rows}x{sequences}"] = _row(medians, flops, differing)
    return results


def measure_engine(args: argparse.Namespace, base_ops, activations: torch.dtype) -> dict:
    """Mean ms per decode step of each --engine case, the base library in every other step."""
    llm = LLM(
        args.model, dtype="auto", max_model_len=max(c for c, _ in args.engine) + args.engine_tokens + 64
    )
    engine = llm.engine
    tree_ops_for = cpu_kernels._ops
    use_base = False

    def ops_for(x: torch.Tensor):  # the engine's every kernel call asks cpu_kernels._ops
        return base_ops if use_base and x.dtype == activations else tree_ops_for(x)

    generator = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.engine_tokens, ignore_eos=True)
    results = {}
    cpu_kernels._ops = ops_for
    try:
        for context, batch in args.engine:
            samples: dict[str, list[float]] = {"base": [], "tree": []}
            for rep in range(args.engine_reps):
                for index in range(batch):
                    prompt = torch.randint(0, vocab, (context,), generator=generator).tolist()
                    # A salt per batch: no prefix of an earlier batch is reused.
                    engine.add_request(
                        f"ab-{context}x{batch}-{rep}-{index}",
                        {"prompt_token_ids": prompt},
                        params,
                        cache_salt=f"ab-{context}x{batch}-{rep}",
                    )
                started: set[str] = set()
                steps = 0
                while engine.has_unfinished_requests():
                    side = ("base", "tree")[(steps + rep) % 2]
                    use_base = side == "base"
                    decoding = len(started) == batch  # every request past its prefill
                    began = time.perf_counter()
                    outputs = engine.step()
                    elapsed = time.perf_counter() - began
                    steps += 1
                    if decoding:
                        samples[side].append(elapsed)
                    started.update(out.request_id for out in outputs if out.outputs[0].token_ids)
            means = {side: statistics.fmean(values) for side, values in samples.items()}
            results[f"{context}x{batch}"] = {
                "ms_per_step": {side: 1e3 * value for side, value in means.items()},
                "ratio": means["base"] / means["tree"],
                "steps": {side: len(values) for side, values in samples.items()},
            }
    finally:
        cpu_kernels._ops = tree_ops_for
        llm.close()  # its engine's threads and KV cache, not left to the process's exit
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cpu = cpu_capabilities()
    tier = cpu_kernels.TIERS[IsaTier.AVX2 if cpu.tier is IsaTier.AVX2 else IsaTier.AVX512]
    reason = cpu_kernels.unavailable_reason(tier.activation_dtype)
    if reason is not None:
        print(
            f"bench_kernel_ab: this tree's {tier.tier.value} kernels do not run here: {reason}",
            file=sys.stderr,
        )
        return 2
    try:
        commit, base_ops = build_base(args.base, tier)
    except ValueError as error:
        print(f"bench_kernel_ab: {error}", file=sys.stderr)
        return 2
    config = load_model_config(resolve_model_dir(args.model))  # the shapes only: no engine
    tree_ops = getattr(torch.ops, tier.namespace)
    results = {
        "cpu": cpu.describe(),
        "tier": tier.tier.value,
        "base": commit,
        "weights": args.weights,
        **measure(args, {"base": base_ops, "tree": tree_ops}, config, tier.activation_dtype),
        "attention": measure_attention(
            args, {"base": base_ops, "tree": tree_ops}, config, tier.activation_dtype
        ),
        "engine": measure_engine(args, base_ops, tier.activation_dtype) if args.engine else {},
    }
    print(
        f"{results['cpu']}; {tier.tier.value} kernels of base {commit[:12]} against this tree's; "
        f"medians of {args.reps}, ratio base / tree"
    )
    for kind in ("cached", "step", "attention"):
        for case, row in results[kind].items():
            ms, gf = row["ms"], row["gflops"]
            print(
                f"{kind:6s} {case:24s} base {ms['base']:8.3f} ms ({gf['base']:5.0f} GFLOPS)  "
                f"tree {ms['tree']:8.3f} ms ({gf['tree']:5.0f})  {row['ratio']:.3f}x  "
                f"{'same bits' if row['differing_outputs'] == 0 else str(row['differing_outputs']) + ' outputs differ'}"
            )
    for case, row in results["engine"].items():
        ms = row["ms_per_step"]
        print(
            f"engine {case:24s} base {ms['base']:8.3f} ms/step  tree {ms['tree']:8.3f} ms/step  "
            f"{row['ratio']:.3f}x  ({row['steps']['base']} + {row['steps']['tree']} decode steps)"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Decode of one request against llama.cpp, BF16 and INT8 weights, interleaved: the quick check.

``bench_engine.py`` makes the same two comparisons among many others (HF, batches, TTFT, a second
turn, an ablation), ~12 minutes on 2 cores; this runs only them, in ~5 minutes, for work on the
single-stream decode path: ours with ``--dtype auto`` against ``llama-bench`` on a BF16 GGUF, and
ours with ``--quantization int8`` against a Q8_0 GGUF of the same weights, the same shape (128 new
tokens after a 256-token context, 2 threads), one repetition of each side in turn, ``--reps``
times; a repetition of each side is the better of two runs (llama-bench's with flash attention
off and on, the faster counting; where both decode alike, as on a Zen 3 at this context, that is
the better of two samples, so ours runs twice), so busy neighbours favour neither side.
Reports medians and their ratios, the ISA tier in force and the DRAM read bandwidth.
Nothing here downloads or builds llama.cpp: ``benchmarks/build_llama_cpp.sh DIR`` does, and
writes both GGUFs into DIR.

    benchmarks/build_llama_cpp.sh /tmp/llama.cpp
    .venv/bin/python benchmarks/bench_decode_vs_llama.py --llama-dir /tmp/llama.cpp
    LLAMA_CPP_ISA=avx2 benchmarks/build_llama_cpp.sh /tmp/llama-avx2
    KUNLUN_CPU_ISA=avx2 .venv/bin/python benchmarks/bench_decode_vs_llama.py --llama-dir /tmp/llama-avx2
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from bench_engine import (  # benchmarks/, beside this script
    Ours,
    best_decode_rate,
    llama_bench_decode_rate,
    measure_bandwidth_gbs,
    prompts_of,
)

from kunlun_runtime.platforms.cpu_features import cpu_capabilities

# (engine options, the GGUF llama.cpp runs beside it) per weight format
FORMATS = {"bf16": ({}, "smollm2-BF16.gguf"), "int8": ({"quantization": "int8"}, "smollm2-Q8_0.gguf")}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--llama-dir", type=Path, required=True, help="what build_llama_cpp.sh built")
    parser.add_argument("--model", default=None, help="HF-format directory (default: embedded SmolLM2)")
    parser.add_argument("--formats", default="bf16,int8", help="comma-separated: bf16, int8")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=256, help="context tokens before the decode")
    parser.add_argument("--new", type=int, default=128, help="tokens decoded")
    parser.add_argument("--bandwidth-mb", type=int, default=1024, help="bytes read to sample DRAM bandwidth")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args(argv)
    args.formats = [f for f in args.formats.split(",") if f]
    unknown = sorted(set(args.formats) - FORMATS.keys())
    if unknown:
        parser.error(f"unknown --formats {unknown}: choose from {sorted(FORMATS)}")
    binary = args.llama_dir / "build" / "bin" / "llama-bench"
    missing = [
        p for p in [binary, *(args.llama_dir / FORMATS[f][1] for f in args.formats)] if not p.is_file()
    ]
    if missing:
        parser.error(
            f"{', '.join(map(str, missing))} missing: run benchmarks/build_llama_cpp.sh {args.llama_dir}"
        )
    args.llama_bench = str(binary)
    return args


def run(args: argparse.Namespace) -> dict:
    from kunlun_runtime.models.model_dir import resolve_model_dir

    torch.set_num_threads(args.threads)
    model_dir = args.model or str(resolve_model_dir(None))
    common = {"dtype": "auto", "max_model_len": args.prompt + args.new + 64, "kv_cache_memory": "256MiB"}
    engines = {f: Ours(model_dir, **common, **FORMATS[f][0]) for f in args.formats}
    vocab = next(iter(engines.values())).llm.engine.model_config.vocab_size
    prompt = prompts_of(1, args.prompt, vocab)
    for engine in engines.values():  # warm-up: kernels built, caches touched
        engine.run(prompt, 4)
    samples: dict[str, dict[str, list[float]]] = {f: {"ours": [], "llama_cpp": []} for f in args.formats}
    for rep in range(args.reps):
        for name, engine in engines.items():
            engine.reset_prefix_cache()
            ours = best_decode_rate(engine.run, prompt, args.new)  # as many runs as llama-bench's sample
            gguf = str(args.llama_dir / FORMATS[name][1])
            theirs = llama_bench_decode_rate(args.llama_bench, gguf, args.threads, args.prompt, args.new)
            samples[name]["ours"].append(ours)
            samples[name]["llama_cpp"].append(theirs)
            print(f"rep {rep} {name}: ours {ours:.1f} tok/s, llama.cpp {theirs:.1f} tok/s", flush=True)
    results: dict = {
        "cpu": cpu_capabilities().describe(),
        "threads": args.threads,
        "sizes": {"prompt": args.prompt, "new": args.new},
        "dram_read_gb_s": measure_bandwidth_gbs(args.bandwidth_mb),
        "formats": {},
    }
    for name, sides in samples.items():
        ours, theirs = statistics.median(sides["ours"]), statistics.median(sides["llama_cpp"])
        results["formats"][name] = {
            "ours_tok_s": ours,
            "llama_cpp_tok_s": theirs,
            "ratio": ours / theirs,
            "samples": sides,
        }
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = run(args)
    print(f"{results['cpu']}; {args.threads} threads; DRAM read {results['dram_read_gb_s']:.1f} GB/s")
    for name, row in results["formats"].items():
        print(
            f"{name}: ours {row['ours_tok_s']:.1f} tok/s, llama.cpp {row['llama_cpp_tok_s']:.1f} tok/s,"
            f" {row['ratio']:.2f}x (medians of {args.reps})"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""INT8 quality against BF16 on the same model: perplexity on a fixed text, and greedy agreement.

Greedy agreement is reported two ways, over a fixed set of prompts:
- positional: both models generate freely; the share of positions with the same token (after the
  first difference the texts drift apart, so this is the strictest reading);
- teacher-forced: the INT8 model scores BF16's greedy continuation token by token; the share of
  positions where INT8's own greedy choice (rank 1) is BF16's token — the usual definition.

    .venv/bin/python benchmarks/bench_int8_quality.py                 # embedded SmolLM2
    .venv/bin/python benchmarks/bench_int8_quality.py --checkpoint DIR  # also a `quantize` checkpoint
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Water boils at a temperature of",
    "The three primary colors are",
    "To make a cup of tea, first",
    "The largest planet in the solar system is",
    "A list of prime numbers: 2, 3, 5,",
]


def fixed_text() -> str:
    """The Python license that ships with the interpreter: fixed, English prose, no download."""
    return (Path(sys.base_prefix) / "lib" / f"python3.{sys.version_info.minor}" / "LICENSE.txt").read_text()


def perplexity(llm, token_ids: list[int]) -> float:
    from kunlun_runtime import SamplingParams

    output = llm.generate({"prompt_token_ids": token_ids}, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    # vLLM's shape: None for the first token, then a dict holding each prompt token's Logprob.
    logprobs = [
        entry[token].logprob for entry, token in zip(output.prompt_logprobs[1:], token_ids[1:], strict=True)
    ]
    return math.exp(-sum(logprobs) / len(logprobs))


def greedy(llm, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from kunlun_runtime import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def teacher_forced_agreement(llm, prompts: list[list[int]], continuations: list[list[int]]) -> float:
    from kunlun_runtime import SamplingParams

    agree = total = 0
    for prompt, continuation in zip(prompts, continuations, strict=True):
        output = llm.generate(
            {"prompt_token_ids": prompt + continuation}, SamplingParams(max_tokens=1, prompt_logprobs=0)
        )[0]
        scored = output.prompt_logprobs[len(prompt) :]
        agree += sum(entry[token].rank == 1 for entry, token in zip(scored, continuation, strict=True))
        total += len(scored)
    return agree / total


def run(args: argparse.Namespace) -> dict:
    from kunlun_runtime import LLM
    from kunlun_runtime.models.model_dir import resolve_model_dir

    model_dir = str(resolve_model_dir(args.model))
    # auto: what serve runs on this CPU's tier (BF16, or FP32 over BF16 weights below AVX-512 BF16),
    # the INT8 variants in the same compute dtype.
    common = {"dtype": "auto", "kv_cache_memory": "512MiB", "max_model_len": args.text_tokens + 64}
    reference = LLM(model_dir, **common)
    text_ids = reference.engine.tokenizer.encode(fixed_text())[: args.text_tokens]
    prompts = [reference.engine.tokenizer.encode(p) for p in PROMPTS[: args.prompts]]
    ref_tokens = greedy(reference, prompts, args.new_tokens)
    results = {
        "model": model_dir,
        "text_tokens": len(text_ids),
        "prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "compute_dtype": str(reference.engine.dtype).removeprefix("torch."),
        "bf16_perplexity": perplexity(reference, text_ids),
        "variants": {},
    }
    variants = {"int8 (on the fly)": LLM(model_dir, quantization="int8", **common)}
    if args.checkpoint:
        variants["int8 checkpoint"] = LLM(str(args.checkpoint), **common)
    for name, llm in variants.items():
        ppl = perplexity(llm, text_ids)
        tokens = greedy(llm, prompts, args.new_tokens)
        same = sum(
            a == b
            for ours, ref in zip(tokens, ref_tokens, strict=True)
            for a, b in zip(ours, ref, strict=True)
        )
        results["variants"][name] = {
            "perplexity": ppl,
            "perplexity_vs_bf16": ppl / results["bf16_perplexity"] - 1,
            "positional_agreement": same / (len(prompts) * args.new_tokens),
            "teacher_forced_agreement": teacher_forced_agreement(llm, prompts, ref_tokens),
        }
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF-format directory (default: embedded SmolLM2)")
    parser.add_argument("--checkpoint", type=Path, default=None, help="a `kunlun-runtime quantize` output")
    parser.add_argument("--text-tokens", type=int, default=1024)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    results = run(args)
    print(
        f"BF16-weight perplexity {results['bf16_perplexity']:.2f} on {results['text_tokens']} tokens"
        f" (computing in {results['compute_dtype']})"
    )
    for name, row in results["variants"].items():
        print(
            f"{name}: perplexity {row['perplexity']:.2f} ({row['perplexity_vs_bf16']:+.1%}), greedy agreement "
            f"teacher-forced {row['teacher_forced_agreement']:.1%}, positional {row['positional_agreement']:.1%}"
        )
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

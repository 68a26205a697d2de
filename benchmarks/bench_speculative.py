"""Speculative decoding benchmark: n-gram drafts against our own decoding without them, side by side.

Two workloads, on one engine each way (same weights, dtype and flags but ``--speculative-config``):

- ``copy``: tasks that repeat their prompt, as users' RAG, editing and extraction do: quote a
  paragraph of a ~1,500-token context verbatim; rewrite a ~1,000-token text with one name changed;
  extract a record's fields from a document as JSON;
- ``free``: open-ended generation with little to copy (stories, explanations).

Each runs at batch 1 (every prompt alone) and batch 8 (eight prompts at once), greedy, alternating
which engine goes first in every repetition (only ratios from one run mean anything on a shared
machine). Reported: decode tok/s (output tokens after the first over the time after the batch's
last first token), the ratio speculative / plain, the mean accepted tokens per verification step
and the acceptance rate. Targets (issue: speculative decoding): copy ≥ 2.0× at batch 1 and ≥ 1.3×
at batch 8; free ≥ 0.97× (no loss).

    .venv/bin/python benchmarks/bench_speculative.py                  # embedded SmolLM2, --dtype auto
    .venv/bin/python benchmarks/bench_speculative.py --quick --model DIR   # smoke run (the test suite)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import engine_batches  # benchmarks/, beside this script

from kunlun_runtime import LLM, SamplingParams

TARGETS = {("copy", 1): 2.0, ("copy", 8): 1.3, ("free", 1): 0.97, ("free", 8): 0.97}
SPEC = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 8, "prompt_lookup_min": 3}

CITIES = ["Harbin", "Shenyang", "Dalian", "Changchun", "Jinan", "Qingdao", "Taiyuan", "Hohhot"]
GOODS = ["steel coil", "copper wire", "cement", "glass panels", "rail sleepers", "transformers"]
NAMES = ["Zhang Wei", "Li Na", "Wang Fang", "Liu Yang", "Chen Jing", "Yang Min", "Zhao Lei"]


def _sentence(rng: random.Random) -> str:
    return (
        f"On {rng.randint(1, 28)} {rng.choice(['March', 'April', 'May', 'June'])} the {rng.choice(CITIES)} "
        f"branch shipped {rng.randint(10, 900)} tonnes of {rng.choice(GOODS)} to {rng.choice(NAMES)}, "
        f"invoice {rng.randint(1000, 9999)}-{rng.choice('ABCDEF')}, payable within {rng.randint(10, 90)} days."
    )


def _document(rng: random.Random, sentences: int) -> str:
    paragraphs = []
    for index in range(0, sentences, 5):
        count = min(5, sentences - index)
        paragraphs.append(f"Section {index // 5 + 1}. " + " ".join(_sentence(rng) for _ in range(count)))
    return "\n\n".join(paragraphs)


def copy_tasks(count: int, scale: float = 1.0) -> list[list[dict[str, str]]]:
    rng = random.Random(7)
    tasks = []
    for index in range(count):
        kind = index % 3
        if kind == 0:
            context = _document(rng, int(40 * scale))
            ask = f"{context}\n\nQuote Section 3 of the text above exactly, word for word."
        elif kind == 1:
            text = _document(rng, int(25 * scale))
            ask = f"{text}\n\nRewrite the text above exactly, but write Harbin instead of Shenyang."
        else:
            record = _document(rng, int(10 * scale))
            ask = f"{record}\n\nList every invoice number, date, city and amount in the text above as JSON lines."
        tasks.append([{"role": "user", "content": ask}])
    return tasks


def free_tasks(count: int) -> list[list[dict[str, str]]]:
    topics = [
        "Write a short story about a lighthouse keeper who finds a map.",
        "Explain why the sky is blue to a ten-year-old.",
        "Describe a walk through a forest in autumn.",
        "Give advice to someone starting to learn the piano.",
        "Write a poem about the sea at night.",
        "Explain how a bicycle stays upright.",
        "Describe your ideal weekend.",
        "Tell a fable about a fox and a crow.",
    ]
    return [[{"role": "user", "content": topics[index % len(topics)]}] for index in range(count)]


def run_batch(llm: LLM, conversations: list[list[dict[str, str]]], max_tokens: int) -> dict:
    tokenizer = llm.engine.tokenizer
    prompts = [
        tokenizer.encode(tokenizer.render_chat(conversation, True), add_special_tokens=False)
        for conversation in conversations
    ]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    timing = engine_batches.run_batch(llm.engine, prompts, params)
    return {"tokens": timing.decode_tokens, "seconds": timing.decode_seconds}


def measure(llm: LLM, tasks, batch: int, max_tokens: int) -> float:
    """Decode tok/s over all ``tasks``, ``batch`` at a time."""
    tokens = seconds = 0.0
    for start in range(0, len(tasks), batch):
        result = run_batch(llm, tasks[start : start + batch], max_tokens)
        tokens += result["tokens"]
        seconds += result["seconds"]
    return tokens / seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="HF-format model directory (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a smoke run: small sizes, one repeat")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args(argv)
    scale, tasks_per_workload = 1.0, 8
    max_model_len: int | None = 4096
    if args.quick:  # prompts of a sentence or two: they fit a tiny test model's context
        args.max_tokens, args.repeats, scale, max_model_len = 8, 1, 0.025, None
    options = {
        "dtype": args.dtype,
        "max_model_len": max_model_len,
        "max_num_batched_tokens": 4096,
        "enable_prefix_caching": False,
    }
    model = args.model
    plain = LLM(model, **options)
    spec = LLM(model, speculative_config=SPEC, **options)
    workloads = {"copy": copy_tasks(tasks_per_workload, scale), "free": free_tasks(tasks_per_workload)}
    for llm in (plain, spec):  # warm-up: kernels, allocator
        run_batch(llm, workloads["free"][:1], 4)
    rates: dict[tuple[str, int, str], list[float]] = {}
    counters_before = spec.engine.spec.counters.totals() if spec.engine.spec else (0, 0, 0, ())
    for repeat in range(args.repeats):
        for name, tasks in workloads.items():
            for batch in (1, 8):
                order = [("plain", plain), ("spec", spec)]
                if repeat % 2:
                    order.reverse()
                for side, llm in order:
                    rates.setdefault((name, batch, side), []).append(
                        measure(llm, tasks, batch, args.max_tokens)
                    )
    assert spec.engine.spec is not None
    drafts, drafted, accepted, _ = spec.engine.spec.counters.totals()
    drafts, drafted, accepted = (
        drafts - counters_before[0],
        drafted - counters_before[1],
        accepted - counters_before[2],
    )
    report: dict = {
        "model": str(plain.engine.model_dir),
        "dtype": str(plain.engine.dtype),
        "speculative_config": SPEC,
        "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
        "mean_accepted_per_verification": round(accepted / drafts, 3) if drafts else 0.0,
    }
    ok = True
    for name in workloads:
        for batch in (1, 8):
            base = statistics.median(rates[name, batch, "plain"])
            ours = statistics.median(rates[name, batch, "spec"])
            ratio = ours / base
            target = TARGETS[name, batch]
            met = ratio >= target
            ok &= met
            report[f"{name}_batch{batch}"] = {
                "plain_tok_s": round(base, 1),
                "spec_tok_s": round(ours, 1),
                "ratio": round(ratio, 3),
                "target": target,
                "met": met,
            }
            print(
                f"{name} batch {batch}: plain {base:.1f} tok/s, speculative {ours:.1f} tok/s = {ratio:.3f}x "
                f"(target >= {target}: {'met' if met else 'MISSED'})"
            )
    print(
        f"acceptance: {report['acceptance_rate']:.3f} of drafted tokens, "
        f"{report['mean_accepted_per_verification']:.2f} accepted per verification"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    plain.close()
    spec.close()
    return 0 if ok or args.quick else 1


if __name__ == "__main__":
    sys.exit(main())

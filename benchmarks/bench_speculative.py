"""Speculative decoding benchmark: n-gram and suffix drafts against our own decoding without them,
side by side.

Two workloads, on one engine per side (same weights, dtype and flags but ``--speculative-config``:
none, ``SPECS["ngram"]``, ``SPECS["suffix"]``; ``--methods`` picks):

- ``copy``: tasks that repeat their prompt, as users' RAG, editing and extraction do: quote a
  paragraph of a ~1,500-token context verbatim; rewrite a ~1,000-token text with one name changed;
  extract a record's fields from a document as JSON;
- ``free``: open-ended generation with little to copy (stories, explanations).

Each runs at batch 1 (every prompt alone), a closed batch of 8 (eight prompts at once) and 8 in
flight (continuous batching over more prompts), greedy; the engines take turns batch by batch (in
flight, run by run, four runs each), the order reversed each time, and which goes first
alternates in every repetition (only ratios from one run mean anything on a shared machine,
whose speed changes within seconds). Reported: decode tok/s, the ratio speculative / plain per
method, and beside it the tokens per request step (one plus the drafts accepted per step, the
steps that drafted nothing included: the ratio if verifying cost nothing) and the ratio over that
(the speculative steps' rate against the plain ones': what verifying cost); per method the mean
accepted tokens per verification step and the acceptance rate. Targets (issue:
speculative decoding): copy ≥ 2.0× at batch 1 and ≥ 1.3× at batch 8; free ≥ 0.97× (no loss).

Decode tok/s of a closed batch is measured two ways: the batch's (output tokens after the first
over the time after its last first token: when its slowest request ends) and its requests' (the
same tokens over the requests' own decode times, 1 / the mean time per output token: what each
client sees). Without drafts every request of a batch ends in the same step and both are equal;
with drafts a request that copies ends early, which its client sees but the batch's time does
not, while the steps that verified its drafts were longer for the others. The engine runs a
draft only where it raises the step's tokens per second, which is the same condition as lowering
its requests' mean time per token, so the target of a closed batch of 8 is its requests' rate;
the batch's (its slowest request's) is reported beside it. 8 in flight is a loaded server's
throughput.

With ``LLAMA_LOOKUP`` (llama.cpp's ``llama-lookup``; ``llama-speculative-simple`` beside it) and
``LLAMA_LOOKUP_GGUF`` (the same weights, BF16 to match ``--dtype auto``), batch 1 also runs
llama.cpp's model-free speculation on the same prompts rendered to text, in the same interleaving:
its plain decoding, ``llama-lookup`` and ``ngram-simple`` (see llama_lookup.py), with the same
draft length and our smallest n-gram; reported: their decode tok/s, acceptance, and our
speculative tok/s against each (the programs decode one sequence, so batch 8 has no llama.cpp side).

    .venv/bin/python benchmarks/bench_speculative.py                  # embedded SmolLM2, --dtype auto
    .venv/bin/python benchmarks/bench_speculative.py --quick --model DIR   # smoke run (the test suite)
    .venv/bin/python benchmarks/bench_speculative.py --methods ngram --workloads copy --batches 1
                                                           # one cell again (a noisy one)
    LLAMA_LOOKUP=DIR/build/bin/llama-lookup LLAMA_LOOKUP_GGUF=DIR/smollm2-BF16.gguf \
      .venv/bin/python benchmarks/bench_speculative.py               # DIR from build_llama_cpp.sh
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import engine_batches  # benchmarks/, beside this script
import llama_lookup

from kunlun_runtime import LLM, SamplingParams
from kunlun_runtime.models.default_model import resolve_default_model
from kunlun_runtime.models.tokenizer import Tokenizer

# Batch sizes: 1 and 8 are closed batches (each set of prompts decoded until its last finishes);
# IN_FLIGHT is 8 requests kept in flight over more prompts (continuous batching), timed over the
# steps in which all 8 decode.
IN_FLIGHT_REQUESTS = 8
IN_FLIGHT_TURNS = 4  # in-flight runs per side and repetition, in turns (measure)
CLOSED_TURNS = 4  # closed batches per side and repetition at least, in turns (measure)
IN_FLIGHT = f"{IN_FLIGHT_REQUESTS} in flight"
BATCHES: tuple[int | str, ...] = (1, 8, IN_FLIGHT)
TARGETS: dict[tuple[str, int | str], float | None] = {
    ("copy", 1): 2.0,
    ("copy", 8): None,  # reported; its tail decodes at batch 1-7 (see measure), the target is in flight
    ("copy", IN_FLIGHT): 1.3,
    ("free", 1): 0.97,
    ("free", 8): 0.97,
    ("free", IN_FLIGHT): 0.97,
}
SPEC = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 8, "prompt_lookup_min": 3}
SPECS = {"ngram": SPEC, "suffix": {"method": "suffix"}}  # suffix: vLLM's defaults (up to 24 drafts)

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
        "Write a letter from a sailor to his daughter.",
        "Explain how bread rises.",
        "Describe a busy railway station at dawn.",
        "Give tips for a first job interview.",
        "Write a short story about a robot that learns to paint.",
        "Explain why leaves change colour in autumn.",
        "Describe a thunderstorm over the mountains.",
        "Tell a story about two friends lost in a city.",
        "Explain how a rainbow forms.",
        "Write a speech for a school's sports day.",
        "Describe the taste of a summer fruit market.",
        "Give advice to someone moving to a new country.",
        "Write a poem about an old clock.",
        "Explain what makes a good friend.",
        "Describe a village festival in winter.",
        "Tell a fable about a tortoise and an eagle.",
    ]
    if count > len(topics):  # a repeated prompt would let suffix drafts copy its earlier answer
        raise ValueError(f"at most {len(topics)} distinct free-generation prompts, asked for {count}")
    return [[{"role": "user", "content": topic}] for topic in topics[:count]]


def prompt_texts(tokenizer: Tokenizer, conversations: list[list[dict[str, str]]]) -> list[str]:
    return [tokenizer.render_chat(conversation, True) for conversation in conversations]


_BATCHES = itertools.count()
CLOSED_TASKS = 8  # prompts per workload at batch 1 and 8; in flight takes all (--in-flight-tasks)


def prompt_ids(llm: LLM, conversations: list[list[dict[str, str]]]) -> list[list[int]]:
    tokenizer = llm.engine.tokenizer
    return [
        tokenizer.encode(text, add_special_tokens=False) for text in prompt_texts(tokenizer, conversations)
    ]


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@dataclass(frozen=True)
class Measured:
    """One side's decode over a cell's batches: the batch's tok/s, its requests' (closed batches;
    None in flight), and the tokens and requests' steps behind them (see yield_per_step)."""

    rate: float
    requests_rate: float | None
    tokens: int
    request_steps: int


def run_batch(llm: LLM, conversations: list[list[dict[str, str]]], max_tokens: int) -> dict:
    """One batch, greedy, as a tenant of its own: the same prompts come back in every repetition,
    and the suffix method's cache of a tenant's answers must not hand a prompt its own earlier
    answer (a repeated question is what that cache is for, but not what this measures)."""
    timing = engine_batches.run_batch(
        llm.engine, prompt_ids(llm, conversations), _params(max_tokens), cache_salt=f"batch-{next(_BATCHES)}"
    )
    return {
        "tokens": timing.decode_tokens,
        "seconds": timing.decode_seconds,
        # Each request's own decode time, averaged: the batch's time as its requests see it.
        "request_seconds": sum(timing.request_decode_seconds) / len(timing.request_decode_seconds),
        "request_steps": timing.request_decode_steps,
    }


def measure(
    engines: dict[str, LLM], sides: list[str], tasks, batch: int | str, max_tokens: int
) -> dict[str, Measured]:
    """Decode tok/s over ``tasks`` of each engine of ``sides`` (the batch's, and its requests'
    where the batch is closed): closed batches of ``batch`` (the first ``CLOSED_TASKS``), or
    ``IN_FLIGHT``: all of them, 8 in flight. Every side runs each closed batch in turn, the order
    reversed from one batch to the next, so a change in the machine's speed during a run (other
    tenants come and go within seconds) falls on the sides alike rather than on whichever ran
    its batches while it lasted; in flight, ``IN_FLIGHT_TURNS`` runs of all the prompts per side,
    taking turns the same way (a run lasts seconds, and one run per side left the ratio to
    whichever of them a busy moment fell on); the closed batches, as many times over as gives each
    side ``CLOSED_TURNS`` batches at least (at batch 8 the 8 prompts were one batch a side, ~2 s
    of free text's decoding: that cell read 0.79-1.07x from run to run while drafting nothing). A
    closed batch of 8 decodes until its last request finishes; with drafts its requests finish
    apart (a copying one in a third of the steps), so most of its time goes to its last few
    requests decoding alone: closed, a speculative engine's batch 8 is mostly batch 1-7, in flight
    it stays 8 (as a server's does while requests queue)."""
    if batch == IN_FLIGHT:
        decoded = {side: [0, 0.0, 0] for side in sides}  # tokens, seconds, requests' steps
        for turn in range(IN_FLIGHT_TURNS):
            for side in sides if turn % 2 == 0 else sides[::-1]:
                timing = engine_batches.run_in_flight(
                    engines[side].engine,
                    prompt_ids(engines[side], tasks),
                    _params(max_tokens),
                    IN_FLIGHT_REQUESTS,
                    cache_salt=f"batch-{next(_BATCHES)}",
                )
                decoded[side][0] += timing.decode_tokens
                decoded[side][1] += timing.decode_seconds
                decoded[side][2] += timing.decode_steps * IN_FLIGHT_REQUESTS  # all of them decode
        return {
            side: Measured(tokens / seconds if seconds else 0.0, None, tokens, steps)
            for side, (tokens, seconds, steps) in decoded.items()
        }
    assert isinstance(batch, int)
    totals = {side: [0, 0.0, 0.0, 0] for side in sides}  # tokens, seconds, requests' seconds and steps
    closed = tasks[:CLOSED_TASKS]
    starts = list(range(0, len(closed), batch))
    for index, start in enumerate(starts * math.ceil(CLOSED_TURNS / len(starts))):
        for side in sides if index % 2 == 0 else sides[::-1]:
            result = run_batch(engines[side], closed[start : start + batch], max_tokens)
            total = totals[side]
            total[0] += result["tokens"]
            total[1] += result["seconds"]
            total[2] += result["request_seconds"]
            total[3] += result["request_steps"]
    # Where every request decodes for the whole batch time (no drafts) the two rates are equal.
    return {
        side: Measured(tokens / seconds, tokens / request, tokens, steps)
        for side, (tokens, seconds, request, steps) in totals.items()
    }


def measure_llama(
    llama: llama_lookup.LlamaLookup, tokenizer: Tokenizer, tasks, side: str, max_tokens: int
) -> list[llama_lookup.LlamaRun]:
    """One llama.cpp run per task (its programs decode one sequence), checking that llama.cpp
    tokenized each prompt to as many tokens as ours."""
    runs = []
    for text in prompt_texts(tokenizer, tasks):
        command = llama_lookup.build_command(
            llama, side, text, max_tokens, SPEC["num_speculative_tokens"], SPEC["prompt_lookup_min"]
        )
        run = llama_lookup.run(command)
        ours = len(tokenizer.encode(text, add_special_tokens=False))
        if run.prompt_tokens != ours:
            print(
                f"WARNING: llama.cpp {side}: prompt of {run.prompt_tokens} tokens, ours {ours}",
                file=sys.stderr,
            )
        runs.append(run)
    return runs


def run_llama(
    llama: llama_lookup.LlamaLookup | None,
    tokenizer: Tokenizer,
    tasks,
    name: str,
    sides: list[str],
    max_tokens: int,
    runs: dict[str, dict[str, list[list[llama_lookup.LlamaRun]]]],
) -> None:
    """llama.cpp's ``sides`` over the closed batches' prompts of workload ``name``, one after another."""
    for side in sides:
        assert llama is not None
        runs[name].setdefault(side, []).append(
            measure_llama(llama, tokenizer, tasks[:CLOSED_TASKS], side, max_tokens)
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="HF-format model directory (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--in-flight-tasks",
        type=int,
        default=24,
        help="prompts per workload decoded 8 in flight (default: 24)",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: small sizes, one repeat")
    parser.add_argument("--json", type=Path, help="write the results here too")
    parser.add_argument(
        "--methods",
        type=lambda text: text.split(","),
        default=list(SPECS),
        help="drafting methods to run beside the plain engine (default: ngram,suffix)",
    )
    parser.add_argument(
        "--workloads",
        type=lambda text: text.split(","),
        default=["copy", "free"],
        help="workloads to run (default: copy,free); with --batches, one cell can be measured again",
    )
    parser.add_argument(
        "--batches",
        nargs="+",
        choices=[str(batch) for batch in BATCHES if isinstance(batch, int)] + ["in-flight"],
        default=None,
        help="batches to run: 1, 8 (closed), in-flight (default: all)",
    )
    parser.add_argument("--llama-threads", type=int, default=2, help="llama.cpp's -t (default: 2)")
    parser.add_argument("--llama-flash-attn", choices=("off", "on"), default="off", help="llama.cpp's -fa")
    parser.add_argument(
        "--llama-only",
        action="store_true",
        help="run only llama.cpp's sides (a check of that side; no comparison with ours)",
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.workloads) - {"copy", "free"})
    if unknown:
        parser.error(f"--workloads: copy and free only, not {','.join(unknown)}")
    args.batches = [batch for batch in BATCHES if args.batches is None or _batch_name(batch) in args.batches]
    if args.quick:  # prompts of a sentence or two: they fit a tiny test model's context
        args.max_tokens, args.repeats, args.in_flight_tasks = 8, 1, 12
    least = max(CLOSED_TASKS, IN_FLIGHT_REQUESTS)  # the closed batches' prompts are its first ones
    if args.in_flight_tasks < least:
        parser.error(f"--in-flight-tasks must be at least {least}")
    try:
        free_tasks(args.in_flight_tasks)
    except ValueError as error:
        parser.error(f"--in-flight-tasks: {error}")
    return args


def _batch_name(batch: int | str) -> str:
    """``--batches``' name of a batch: its size, or in-flight."""
    return str(batch) if isinstance(batch, int) else "in-flight"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    scale = 0.025 if args.quick else 1.0
    max_model_len: int | None = None if args.quick else 4096
    llama = llama_lookup.from_env(args.llama_threads, args.llama_flash_attn, max_model_len or 4096)
    if args.llama_only and llama is None:
        raise SystemExit(f"--llama-only needs {llama_lookup.LOOKUP_ENV} and {llama_lookup.GGUF_ENV}")
    options = {
        "dtype": args.dtype,
        "max_model_len": max_model_len,
        "max_num_batched_tokens": 4096,
        "enable_prefix_caching": False,
    }
    engines: dict[str, LLM] = {}
    if not args.llama_only:
        engines["plain"] = LLM(args.model, **options)
        for method in args.methods:
            engines[method] = LLM(args.model, speculative_config=SPECS[method], **options)
    plain = engines.get("plain")
    tokenizer = plain.engine.tokenizer if plain else Tokenizer(Path(args.model or resolve_default_model()))
    workloads = {  # the first CLOSED_TASKS of each are the closed batches' prompts
        "copy": copy_tasks(args.in_flight_tasks, scale),
        "free": free_tasks(args.in_flight_tasks),
    }
    warm_up = workloads["free"][:1]
    workloads = {name: tasks for name, tasks in workloads.items() if name in args.workloads}
    for llm in engines.values():  # warm-up: kernels, allocator
        run_batch(llm, warm_up, 4)
    rates: dict[tuple[str, int | str, str], list[Measured]] = {}
    llama_runs: dict[str, dict[str, list[list[llama_lookup.LlamaRun]]]] = {name: {} for name in workloads}
    counters_before = {method: _counters(engines[method]) for method in engines if method != "plain"}
    for repeat in range(args.repeats):
        for name, tasks in workloads.items():
            for batch in args.batches:
                our_sides = list(engines)
                llama_sides = list(llama_lookup.SIDES) if llama is not None and batch == 1 else []
                if repeat % 2:
                    our_sides.reverse()
                    llama_sides.reverse()
                # Ours side by side, batch by batch (measure); llama.cpp's sides (by side: both
                # have a "plain") before ours in every other repetition, after them in the others.
                if repeat % 2:
                    run_llama(llama, tokenizer, tasks, name, llama_sides, args.max_tokens, llama_runs)
                if our_sides:
                    for side, rate in measure(engines, our_sides, tasks, batch, args.max_tokens).items():
                        rates.setdefault((name, batch, side), []).append(rate)
                if not repeat % 2:
                    run_llama(llama, tokenizer, tasks, name, llama_sides, args.max_tokens, llama_runs)
    report: dict = {}
    ok = True
    if plain is not None:
        for method in args.methods:
            report[method], met = ours_report(
                method, engines[method], counters_before[method], rates, workloads, args.batches
            )
            ok &= met
    if llama is not None and 1 in args.batches:  # llama.cpp runs beside batch 1 only
        report["llama_cpp"] = {
            "gguf": str(llama.gguf),
            "threads": llama.threads,
            "flash_attn": llama.flash_attn,
        }
        for name in workloads:
            ours = report.get("ngram", {}).get(f"{name}_batch1")  # n-gram against llama.cpp's n-gram sides
            report["llama_cpp"][f"{name}_batch1"] = llama_lookup.report(name, llama_runs[name], ours)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    for llm in engines.values():
        llm.close()
    return 0 if ok or args.quick else 1


def _rate(measured: Measured, requests: bool) -> float:
    rate = measured.requests_rate if requests else measured.rate
    assert rate is not None, "in flight has no requests' rate"
    return rate


def yield_per_step(measured: list[Measured]) -> float:
    """Decode tokens per request step over a side's repetitions of a cell: 1 without drafts; with
    them, one plus the accepted drafts per step, counting the steps that drafted nothing. It is
    the speed-up speculation would give if a step that verifies drafts cost no more than a plain
    one; the measured ratio over it is what verifying (and drafting) cost in step rate."""
    steps = sum(m.request_steps for m in measured)
    return sum(m.tokens for m in measured) / steps if steps else 0.0


def _counters(llm: LLM) -> tuple[int, int, int, tuple[int, ...]]:
    assert llm.engine.spec is not None
    return llm.engine.spec.counters.totals()


def ours_report(
    method: str, spec: LLM, counters_before, rates, workloads, batches: list[int | str]
) -> tuple[dict, bool]:
    """One method's figures per workload and batch run against the plain engine and the targets,
    printed; whether all were met."""
    drafts, drafted, accepted, _ = _counters(spec)
    drafts, drafted, accepted = (
        drafts - counters_before[0],
        drafted - counters_before[1],
        accepted - counters_before[2],
    )
    report: dict = {
        "model": str(spec.engine.model_dir),
        "dtype": str(spec.engine.dtype),
        "speculative_config": SPECS[method],
        "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
        "mean_accepted_per_verification": round(accepted / drafts, 3) if drafts else 0.0,
    }
    ok = True
    for name in workloads:
        for batch in batches:
            plain, spec_side = rates[name, batch, "plain"], rates[name, batch, method]
            # The target's measure: the requests' rate of a closed batch of 8, else the batch's.
            requests = batch != 1 and isinstance(batch, int)
            base = statistics.median(_rate(rate, requests) for rate in plain)
            ours = statistics.median(_rate(rate, requests) for rate in spec_side)
            ratio = round(ours / base, 3)  # the verdict is taken on the number reported
            per_step = yield_per_step(spec_side)
            target = TARGETS[name, batch]
            met = target is None or ratio >= target
            ok &= met
            key = (
                f"{name}_batch{batch}"
                if isinstance(batch, int)
                else f"{name}_batch{IN_FLIGHT_REQUESTS}_in_flight"
            )
            report[key] = {
                "plain_tok_s": round(base, 1),
                "spec_tok_s": round(ours, 1),
                "ratio": ratio,
                "target": target,
                "met": met,
                "plain_tokens_per_step": round(yield_per_step(plain), 3),
                "tokens_per_step": round(per_step, 3),
                "step_rate_ratio": round(ratio / per_step, 3) if per_step else 0.0,
            }
            verdict = "no target" if target is None else f"target >= {target}: {'met' if met else 'MISSED'}"
            what = "its requests' " if requests else ""
            line = (
                f"{method} {name} batch {batch}: plain {base:.1f} tok/s, speculative {ours:.1f} tok/s "
                f"= {ratio:.3f}x {what}({verdict}); {per_step:.2f} tokens per step, "
                f"its steps at {report[key]['step_rate_ratio']:.3f}x the plain steps' rate"
            )
            if requests:  # the closed batch's own rate (until its slowest request ends) beside it
                batch_base = statistics.median(rate.rate for rate in plain)
                batch_ours = statistics.median(rate.rate for rate in spec_side)
                report[key]["batch_ratio"] = round(batch_ours / batch_base, 3)
                line += f"; the batch's {batch_base:.1f} and {batch_ours:.1f} tok/s = {batch_ours / batch_base:.3f}x"
            print(line)
    print(
        f"{method} acceptance: {report['acceptance_rate']:.3f} of drafted tokens, "
        f"{report['mean_accepted_per_verification']:.2f} accepted per verification"
    )
    return report, ok


if __name__ == "__main__":
    sys.exit(main())

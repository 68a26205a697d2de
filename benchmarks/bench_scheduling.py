"""Scheduling benchmark: the ``fixed`` policy vs ``feedback`` on a mixed workload, side by side.

The workload is open-loop: short chats (a shared system prompt plus a short question) and long
documents arrive over time at a seeded random (Poisson) rate; every request has a fixed output
length (``ignore_eos``). ``--workload docqa`` adds follow-up questions on each document (the
document's tokens plus a question, arriving a few seconds after it), as in document QA, and is
meant to be run with a KV pool that holds only a few documents (``--kv-cache-memory``): whether a
follow-up finds its document still resident depends on the order the scheduler serves the queue.

Each repetition runs the same workload on both policies, alternating which goes first, in one
process (these machines are shared and noisy: only ratios from one run mean anything). Reports
p50/p99 time to first token, p99 inter-token latency, output throughput and the fraction of prompt
tokens served from the prefix cache per policy over all repetitions, and feedback/fixed ratios.

    .venv/bin/python benchmarks/bench_scheduling.py                      # embedded SmolLM2
    .venv/bin/python benchmarks/bench_scheduling.py --quick --model DIR  # smoke run (the test suite)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

POLICIES = ("fixed", "feedback")


@dataclass(frozen=True, slots=True)
class Job:
    request_id: str
    kind: str  # "chat" | "doc"
    arrival_seconds: float
    prompt_token_ids: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Shape:
    num_requests: int
    rate_per_second: float
    doc_fraction: float
    system_tokens: int
    chat_tokens: tuple[int, int]
    doc_tokens: tuple[int, int]
    chat_output: tuple[int, int]
    doc_output: tuple[int, int]
    followups: tuple[int, int] = (0, 0)  # follow-up questions per document
    followup_delay_seconds: float = 0.0  # mean delay of a follow-up after its document (exponential)
    followup_tokens: tuple[int, int] = (16, 48)


FULL = Shape(32, 1.2, 0.2, 48, (16, 120), (700, 1400), (24, 64), (16, 32))
QUICK = Shape(8, 50.0, 0.25, 8, (4, 12), (40, 80), (3, 6), (2, 4))
DOCQA = Shape(24, 0.5, 0.4, 48, (16, 120), (700, 1400), (24, 64), (16, 32), (1, 2), 4.0)
DOCQA_QUICK = Shape(8, 50.0, 0.5, 8, (4, 12), (40, 80), (3, 6), (2, 4), (1, 2), 0.05, (4, 8))
WORKLOADS = {"mixed": (FULL, QUICK), "docqa": (DOCQA, DOCQA_QUICK)}


def build_workload(shape: Shape, seed: int, vocab_size: int) -> list[Job]:
    """A seeded mix of chats and documents with exponential inter-arrival times; each document
    is followed by ``shape.followups`` questions on it (its tokens plus a question), ordered by
    arrival."""
    rng = random.Random(seed)
    system = [rng.randrange(100, vocab_size) for _ in range(shape.system_tokens)]
    jobs, clock = [], 0.0
    for index in range(shape.num_requests):
        clock += rng.expovariate(shape.rate_per_second)
        if rng.random() < shape.doc_fraction:
            prompt = [rng.randrange(100, vocab_size) for _ in range(rng.randint(*shape.doc_tokens))]
            jobs.append(Job(f"doc-{index}", "doc", clock, tuple(prompt), rng.randint(*shape.doc_output)))
            arrival = clock
            for number in range(rng.randint(*shape.followups)):
                arrival += rng.expovariate(1.0 / shape.followup_delay_seconds)
                question = [
                    rng.randrange(100, vocab_size) for _ in range(rng.randint(*shape.followup_tokens))
                ]
                output = rng.randint(*shape.chat_output)
                jobs.append(
                    Job(f"followup-{index}-{number}", "followup", arrival, tuple(prompt + question), output)
                )
        else:
            question = [rng.randrange(100, vocab_size) for _ in range(rng.randint(*shape.chat_tokens))]
            jobs.append(
                Job(f"chat-{index}", "chat", clock, tuple(system + question), rng.randint(*shape.chat_output))
            )
    return sorted(jobs, key=lambda job: job.arrival_seconds)


@dataclass(slots=True)
class RunResult:
    ttft_seconds: dict[str, float] = field(default_factory=dict)  # request id → time to first token
    gaps_seconds: list[float] = field(default_factory=list)  # every inter-token gap of every request
    num_output_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    makespan_seconds: float = 0.0

    @property
    def throughput(self) -> float:
        return self.num_output_tokens / self.makespan_seconds


def run_workload(engine, jobs: list[Job], tag: str) -> RunResult:
    """Feed ``jobs`` to the engine at their arrival times and step it until all have finished."""
    from kunlun_runtime import SamplingParams

    result, pending, last = RunResult(), list(jobs), {}
    arrival = {f"{tag}-{job.request_id}": job.arrival_seconds for job in jobs}
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0].arrival_seconds <= now:
            job = pending.pop(0)
            params = SamplingParams(temperature=0, max_tokens=job.max_tokens, ignore_eos=True)
            engine.add_request(
                f"{tag}-{job.request_id}", {"prompt_token_ids": list(job.prompt_token_ids)}, params
            )
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(pending[0].arrival_seconds - now, 0.05)))  # idle until the next arrival
            continue
        outputs = engine.step()
        now = time.perf_counter() - start
        for output in outputs:
            rid = output.request_id
            result.num_output_tokens += len(output.new_token_ids)
            if rid in last:
                result.gaps_seconds.append(now - last[rid])
            else:
                result.ttft_seconds[rid.removeprefix(f"{tag}-")] = now - arrival[rid]
                result.num_prompt_tokens += len(output.prompt_token_ids)
                result.num_cached_prompt_tokens += output.num_cached_tokens
            last[rid] = now
    result.makespan_seconds = time.perf_counter() - start
    return result


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(runs: list[RunResult], jobs_per_rep: list[list[Job]]) -> dict[str, float]:
    ttft = [t for run in runs for t in run.ttft_seconds.values()]
    kinds = {job.request_id: job.kind for jobs in jobs_per_rep for job in jobs}
    chat = [t for run in runs for rid, t in run.ttft_seconds.items() if kinds[rid] == "chat"]
    doc = [t for run in runs for rid, t in run.ttft_seconds.items() if kinds[rid] == "doc"]
    gaps = [g for run in runs for g in run.gaps_seconds]
    return {
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
        "ttft_chat_p50_s": percentile(chat, 0.5) if chat else float("nan"),
        "ttft_doc_p50_s": percentile(doc, 0.5) if doc else float("nan"),
        "itl_p50_s": percentile(gaps, 0.5),
        "itl_p99_s": percentile(gaps, 0.99),
        "throughput_tok_s": statistics.median(run.throughput for run in runs),
        "cached_prompt_fraction": sum(run.num_cached_prompt_tokens for run in runs)
        / sum(run.num_prompt_tokens for run in runs),
    }


def make_llm(model: str | None, policy: str, args: argparse.Namespace):
    from kunlun_runtime import LLM

    options = {"scheduling_policy": policy, "max_num_batched_tokens": args.max_num_batched_tokens}
    if policy == "feedback" and args.target_step_seconds is not None:
        options["target_step_seconds"] = args.target_step_seconds
    if args.dtype:
        options["dtype"] = args.dtype
    if args.kv_cache_memory:
        options["kv_cache_memory"] = args.kv_cache_memory
    if args.max_model_len:
        options["max_model_len"] = args.max_model_len
    return LLM(model, **options)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF-format model directory (default: embedded SmolLM2)")
    parser.add_argument("--quick", action="store_true", help="tiny workload, one repetition (smoke test)")
    parser.add_argument(
        "--workload", choices=sorted(WORKLOADS), default="mixed", help="mixed (chats + documents) or docqa"
    )
    parser.add_argument("--kv-cache-memory", default=None, help="KV pool size, e.g. 128MiB (default 1GiB)")
    parser.add_argument("--max-model-len", type=int, default=None, help="(default: the model's)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (default 5, quick 1)")
    parser.add_argument("--requests", type=int, default=None, help="requests per repetition")
    parser.add_argument("--rate", type=float, default=None, help="arrivals per second")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1: steadier on shared machines)"
    )
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument(
        "--target-step-seconds", type=float, default=None, help="feedback target (default: derived)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    full, quick = WORKLOADS[args.workload]
    shape = quick if args.quick else full
    if args.requests is not None or args.rate is not None:
        shape = replace(
            shape,
            num_requests=args.requests or shape.num_requests,
            rate_per_second=args.rate or shape.rate_per_second,
        )
    reps = args.reps or (1 if args.quick else 5)  # 3 left p99 to one slow repetition

    llms = {policy: make_llm(args.model, policy, args) for policy in POLICIES}
    vocab_size = llms["fixed"].engine.model_config.vocab_size
    warmup = build_workload(QUICK, seed=10_000, vocab_size=vocab_size)
    for policy, llm in llms.items():
        run_workload(llm.engine, warmup, f"warmup-{policy}")  # also gives feedback its first steps
    runs: dict[str, list[RunResult]] = {policy: [] for policy in POLICIES}
    workloads = []
    for rep in range(reps):
        jobs = build_workload(shape, seed=args.seed + rep, vocab_size=vocab_size)
        workloads.append(jobs)
        order = POLICIES if rep % 2 == 0 else tuple(reversed(POLICIES))
        for policy in order:
            llms[policy].engine.block_pool.reset_prefix_cache()
            runs[policy].append(run_workload(llms[policy].engine, jobs, f"{policy}-{rep}"))
            print(f"rep {rep} {policy}: {runs[policy][-1].makespan_seconds:.1f} s", file=sys.stderr)
    summary = {policy: summarize(runs[policy], workloads) for policy in POLICIES}
    ratios = {key: ratio(summary["feedback"][key], summary["fixed"][key]) for key in summary["fixed"]}
    paired = paired_ratios(runs, workloads)
    print_table(summary, ratios, paired, shape, reps, args)
    if args.json is not None:
        results = {
            "shape": shape_dict(shape),
            "reps": reps,
            **summary,
            "ratio": ratios,
            "paired_ratio": paired,
            "runs": {  # per repetition: its makespan and every request's time to first token
                policy: [
                    {"makespan_s": run.makespan_seconds, "ttft_s": run.ttft_seconds} for run in runs[policy]
                ]
                for policy in POLICIES
            },
        }
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def paired_ratios(runs: dict[str, list[RunResult]], workloads: list[list[Job]]) -> dict[str, float]:
    """Median over repetitions of feedback/fixed within each repetition: the two runs of a pair
    are adjacent in time, so slow drift of a shared machine cancels out of the ratio."""
    per_rep = [
        (summarize([runs["fixed"][i]], [jobs]), summarize([runs["feedback"][i]], [jobs]))
        for i, jobs in enumerate(workloads)
    ]
    return {
        key: statistics.median(ratio(feedback[key], fixed[key]) for fixed, feedback in per_rep)
        for key in per_rep[0][0]
    }


def ratio(value: float, baseline: float) -> float:
    """value / baseline; NaN when the baseline is 0 (no prompt token was cached under it)."""
    return value / baseline if baseline else float("nan")


def shape_dict(shape: Shape) -> dict:
    return {name: getattr(shape, name) for name in Shape.__slots__}


def print_table(
    summary: dict, ratios: dict, paired: dict, shape: Shape, reps: int, args: argparse.Namespace
) -> None:
    print(
        f"{args.workload} workload: {shape.num_requests} requests/rep × {reps} reps, {shape.rate_per_second}/s, "
        f"{shape.doc_fraction:.0%} documents of {shape.doc_tokens[0]}-{shape.doc_tokens[1]} tokens"
        + (f" with {shape.followups[0]}-{shape.followups[1]} follow-ups" if shape.followups[1] else "")
        + f"; threads={args.threads}, max_num_batched_tokens={args.max_num_batched_tokens}, "
        f"kv_cache_memory={args.kv_cache_memory or 'default'}, "
        f"target_step_seconds={args.target_step_seconds or 'derived'}"
    )
    print(f"{'metric':<18}{'fixed':>12}{'feedback':>12}{'feedback/fixed':>16}{'paired median':>15}")
    for key in summary["fixed"]:
        fixed, feedback = summary["fixed"][key], summary["feedback"][key]
        print(f"{key:<18}{fixed:>12.3f}{feedback:>12.3f}{ratios[key]:>16.2f}{paired[key]:>15.2f}")


if __name__ == "__main__":
    raise SystemExit(main())

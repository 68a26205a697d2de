"""Routing benchmark: one multi-turn chat workload replayed across replicas, round-robin against
prefix-aware picking, side by side in one run.

Each mode gets a fresh fleet of ``kunlun-runtime serve`` replicas on loopback (``--replicas``, each
held to ``--threads-per-replica`` threads so that they share this machine's cores as pods share a
node) and replays the same workload: conversations start at seeded Poisson times (open loop); each
opens with a shared system prompt and its own ~``--history-tokens`` document, and every turn after
the first is sent a seeded think time after the previous answer arrived, with that answer in its
history (greedy, ``--answer-tokens`` tokens). Modes:

- ``round_robin``: what a plain Kubernetes Service does;
- ``prefix_aware``: the Endpoint Picker stand-in of ``routing_picker.py``, reading only what an EPP
  reads: each replica's ``/metrics`` (queue, running, KV use, block size and count), the prompt's
  tokens (``/tokenize``) and the picks it made itself (the extension's approximate prefix index);
  its scorers are the extension's default profile plus its running-requests scorer
  (``--running-weight 0`` leaves that out);
- ``precise``: the same scorers, the prefix index built from the replicas' KV events (ZeroMQ,
  ``--kv-events-config``; hashes ``sha256_cbor`` recomputed from tokens, as llm-d's indexer does);
- ``single``: the reference, every conversation on one replica (its prefix hit rate is the best
  routing can reach).

Reports per mode TTFT p50/p90 (client side, from the moment a turn is due, picking included), the
fleet's prefix-cache hit rate (``vllm:prefix_cache_hits_total`` over ``..._queries_total``, summed
over replicas), output throughput, and the ratios to round-robin and to the single replica.

    .venv/bin/python benchmarks/bench_routing.py                       # embedded SmolLM2, all modes
    .venv/bin/python benchmarks/bench_routing.py --quick --model DIR   # smoke run (the test suite)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import sys
import time
from dataclasses import dataclass

import httpx
from routing_fleet import Replica, fleet, machine_busy_seconds, own_cpu_seconds, read_counters
from routing_router import make_router

MODES = ("round_robin", "prefix_aware", "precise", "single")
WORDS = (
    "river", "stone", "market", "engine", "window", "garden", "signal", "paper", "orbit", "silver",
    "harbor", "lantern", "meadow", "copper", "valley", "thunder", "pocket", "ribbon", "canyon",
    "marble", "falcon", "timber", "quartz", "beacon", "glacier", "cobalt", "saddle", "ember",
    "willow", "anchor", "prism", "velvet", "summit", "tundra", "hollow", "cipher", "mosaic",
    "quiver", "ledger",
)  # fmt: skip
TARGET_TTFT_P50_RATIO = 0.4  # prefix-aware p50 TTFT at most this much of round-robin's
TARGET_HIT_RATE_RATIO = 0.9  # prefix-aware hit rate at least this much of a single replica's
TARGETS_SAID = {1.0: "met", 0.0: "missed"}


@dataclass(frozen=True, slots=True)
class Conversation:
    start_seconds: float
    document: str  # the conversation's own history: what its turns share
    questions: tuple[str, ...]  # one user message per turn
    think_seconds: tuple[float, ...]  # after each answer, before the next turn


@dataclass(frozen=True, slots=True)
class TurnResult:
    conversation: int
    turn: int
    replica: int
    ttft_seconds: float
    prompt_tokens: int
    completion_tokens: int


def words_text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def build_workload(args: argparse.Namespace, tokens_per_word: float) -> tuple[str, list[Conversation]]:
    """The shared system prompt and the conversations, all from ``args.seed``."""
    rng = random.Random(args.seed)
    system = "You are a careful assistant. " + words_text(
        rng, max(1, round(args.history_tokens * 0.1 / tokens_per_word))
    )
    document_words = max(1, round(args.history_tokens * 0.9 / tokens_per_word))
    conversations, start = [], 0.0
    for _ in range(args.conversations):
        start += rng.expovariate(args.rate)
        questions = tuple(f"Question {t + 1}: what about {words_text(rng, 6)}?" for t in range(args.turns))
        thinks = tuple(
            rng.expovariate(1 / args.think_seconds) if args.think_seconds else 0.0 for _ in questions
        )
        conversations.append(Conversation(start, words_text(rng, document_words), questions, thinks))
    return system, conversations


async def one_turn(http: httpx.AsyncClient, replica: Replica, model: str, messages: list[dict], max_tokens: int,
                   due: float) -> tuple[float, str, int, int]:  # fmt: skip
    """Stream one chat turn; (TTFT from ``due``, answer text, prompt tokens, completion tokens)."""
    body = {
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    first, parts, usage = None, [], {}
    async with http.stream("POST", f"{replica.base_url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                text = (choice.get("delta") or {}).get("content")
                if text:
                    first = first if first is not None else time.perf_counter()
                    parts.append(text)
    ttft = (first if first is not None else time.perf_counter()) - due
    return ttft, "".join(parts), usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)


async def replay(args: argparse.Namespace, mode: str, replicas: list[Replica], system: str,
                 conversations: list[Conversation]) -> tuple[list[TurnResult], list[str], float, dict]:  # fmt: skip
    """Replay the workload through the mode's router; (turn results, errors, makespan seconds,
    what the picker believed)."""
    results: list[TurnResult] = []
    errors: list[str] = []
    limits = httpx.Limits(max_connections=4 * len(conversations) + 16)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        router = make_router(mode, http, replicas, args)
        await router.start()
        began = time.perf_counter()

        async def converse(index: int, conversation: Conversation) -> None:
            await asyncio.sleep(conversation.start_seconds)
            history = [{"role": "system", "content": system}]
            for turn, question in enumerate(conversation.questions):
                content = f"{conversation.document}\n\n{question}" if turn == 0 else question
                messages = [*history, {"role": "user", "content": content}]
                due = time.perf_counter()
                try:
                    replica = await router.choose(messages)
                    ttft, answer, prompt, completion = await one_turn(
                        http, replicas[replica], args.served_model_name, messages, args.answer_tokens, due
                    )
                except httpx.HTTPError as error:
                    errors.append(f"conversation {index} turn {turn}: {error!r}")
                    return
                results.append(TurnResult(index, turn, replica, ttft, prompt, completion))
                history = [*messages, {"role": "assistant", "content": answer}]
                await asyncio.sleep(conversation.think_seconds[turn])

        await asyncio.gather(*(converse(i, c) for i, c in enumerate(conversations)))
        makespan = time.perf_counter() - began
        await router.stop()
    return results, errors, makespan, router.stats()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summarise(mode: str, results: list[TurnResult], errors: list[str], makespan: float, hits: float,
              queries: float, num_replicas: int, num_expected: int) -> dict[str, object]:  # fmt: skip
    ttfts = [r.ttft_seconds for r in results]
    completion = sum(r.completion_tokens for r in results)
    return {
        "mode": mode,
        "num_replicas": num_replicas,
        "num_requests": num_expected,
        "num_completed": len(results),
        "errors": errors,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "ttft_later_turns_p50_s": percentile([r.ttft_seconds for r in results if r.turn > 0], 50),
        "prefix_hit_rate": hits / queries if queries else math.nan,
        "prefix_hit_tokens": hits,
        "prefix_query_tokens": queries,
        "prompt_tokens": sum(r.prompt_tokens for r in results),
        "output_tokens": completion,
        "output_tokens_per_s": completion / makespan if makespan else math.nan,
        "requests_per_s": len(results) / makespan if makespan else math.nan,
        "makespan_s": makespan,
        "requests_per_replica": [sum(1 for r in results if r.replica == i) for i in range(num_replicas)],
    }


def wait_quiet(max_load: float, deadline_seconds: float = 900.0) -> float:
    """Wait (up to the deadline) until the 1-minute load average is below ``max_load`` (0: do not
    wait); returns it, for the report."""
    deadline = time.monotonic() + deadline_seconds
    while max_load and os.getloadavg()[0] >= max_load and time.monotonic() < deadline:
        time.sleep(5)
    load = os.getloadavg()[0]
    if max_load and load >= max_load:
        print(
            f"load average still {load:.2f} after {deadline_seconds:.0f} s; measuring anyway", file=sys.stderr
        )
    return load


async def run_mode(args: argparse.Namespace, mode: str, tokens_per_word: float | None) -> tuple[dict, float]:
    """Start the mode's fleet, calibrate the workload on it once, replay, summarise."""
    count = 1 if mode == "single" else args.replicas
    load_before = wait_quiet(args.quiet_load)  # others' work on this machine skews the timings
    with fleet(args, count, events=mode == "precise") as replicas:
        async with httpx.AsyncClient(timeout=60) as http:
            if tokens_per_word is None:
                sample = words_text(random.Random(0), 200)
                reply = await http.post(f"{replicas[0].base_url}/tokenize",
                                        json={"prompt": sample, "add_special_tokens": False})  # fmt: skip
                reply.raise_for_status()
                tokens_per_word = reply.json()["count"] / 200
            before = [await read_counters(http, r) for r in replicas]
        system, conversations = build_workload(args, tokens_per_word)
        busy, own = machine_busy_seconds(), own_cpu_seconds(replicas)
        results, errors, makespan, picker = await replay(args, mode, replicas, system, conversations)
        # What others ran on this machine meanwhile, as a share of its cores: timings are only
        # comparable between modes that ran with little of it.
        others = (machine_busy_seconds() - busy) - (own_cpu_seconds(replicas) - own)
        async with httpx.AsyncClient(timeout=60) as http:
            after = [await read_counters(http, r) for r in replicas]
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    num_expected = args.conversations * args.turns
    summary = summarise(mode, results, errors, makespan, hits, queries, count, num_expected)
    machine = {
        "load_average_1m_before": load_before,
        "others_cpu_share": others / (makespan * (os.cpu_count() or 1)),
    }
    return {**summary, "picker": picker, **machine}, tokens_per_word


def ratio(numerator: object, denominator: object) -> float:
    if not isinstance(numerator, float | int) or not isinstance(denominator, float | int) or not denominator:
        return math.nan
    return numerator / denominator


def build_report(args: argparse.Namespace, modes: dict[str, dict]) -> dict[str, object]:
    base, single = modes.get("round_robin"), modes.get("single")
    ratios: dict[str, dict[str, float]] = {}
    for mode in ("prefix_aware", "precise"):
        if mode not in modes:
            continue
        row = modes[mode]
        ratios[mode] = {
            "ttft_p50_vs_round_robin": ratio(row["ttft_p50_s"], base["ttft_p50_s"]) if base else math.nan,
            "ttft_p90_vs_round_robin": ratio(row["ttft_p90_s"], base["ttft_p90_s"]) if base else math.nan,
            "throughput_vs_round_robin": ratio(row["output_tokens_per_s"], base["output_tokens_per_s"])
            if base
            else math.nan,
            "hit_rate_vs_single": ratio(row["prefix_hit_rate"], single["prefix_hit_rate"])
            if single
            else math.nan,
        }
        ttft, hit_rate = ratios[mode]["ttft_p50_vs_round_robin"], ratios[mode]["hit_rate_vs_single"]
        met = ttft <= TARGET_TTFT_P50_RATIO and hit_rate >= TARGET_HIT_RATE_RATIO
        # 1 met, 0 missed, NaN unknown (round-robin or the single replica was not run)
        ratios[mode]["targets_met"] = math.nan if math.isnan(ttft) or math.isnan(hit_rate) else float(met)
    config = {k: v for k, v in vars(args).items() if k not in ("json", "modes")}
    return {"config": config, "modes": modes, "ratios": ratios,
            "targets": {"ttft_p50_vs_round_robin_max": TARGET_TTFT_P50_RATIO,
                        "hit_rate_vs_single_min": TARGET_HIT_RATE_RATIO}}  # fmt: skip


def print_table(report: dict) -> None:
    modes = report["modes"]
    print(
        f"{'mode':>13} {'replicas':>8} {'done':>7} {'TTFT p50':>9} {'TTFT p90':>9} {'hit rate':>8} {'out tok/s':>9}"
    )
    for name, row in modes.items():
        done = f"{row['num_completed']}/{row['num_requests']}"
        print(f"{name:>13} {row['num_replicas']:>8} {done:>7} {row['ttft_p50_s']:>8.3f}s {row['ttft_p90_s']:>8.3f}s "
              f"{row['prefix_hit_rate']:>8.3f} {row['output_tokens_per_s']:>9.1f}")  # fmt: skip
    for name, row in report["ratios"].items():
        print(f"{name}: TTFT p50 {row['ttft_p50_vs_round_robin']:.3f}x round-robin, p90 "
              f"{row['ttft_p90_vs_round_robin']:.3f}x, throughput {row['throughput_vs_round_robin']:.3f}x, "
              f"hit rate {row['hit_rate_vs_single']:.3f}x single replica; "
              f"targets: {TARGETS_SAID.get(row['targets_met'], 'unknown')}")  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--model", default=None, help="model directory for the replicas (default: the embedded SmolLM2)")
    add("--served-model-name", default="routed")
    add("--dtype", default=None, help="the replicas' --dtype (default: theirs)")
    add("--replicas", type=int, default=3)
    add("--threads-per-replica", type=int, default=1, help="OMP_NUM_THREADS of each replica")
    add("--kv-cache-memory", default="1536MiB", help="each replica's; enough to hold the whole workload")
    add("--conversations", type=int, default=24)
    add("--turns", type=int, default=4)
    add("--history-tokens", type=int, default=1500, help="system prompt + document, in tokens (about)")
    add("--answer-tokens", type=int, default=32)
    add("--rate", type=float, default=0.1, help="conversations started per second (Poisson)")
    add("--think-seconds", type=float, default=3.0, help="mean pause between an answer and the next turn")
    add("--scrape-interval", type=float, default=0.1, help="seconds between the picker's /metrics scrapes")
    add("--running-weight", type=float, default=2.0,
        help="weight of the extension's running-requests scorer; 0 gives its default profile, which "
        "sends every conversation after a shared system prompt to one replica (docs/performance.md)")  # fmt: skip
    add("--hash-seed", default="1234", help="PYTHONHASHSEED of the precise mode's replicas")
    add("--quiet-load", type=float, default=0.0,
        help="before each mode, wait until the 1-minute load average is below this (0: do not wait)")  # fmt: skip
    add("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    add("--seed", type=int, default=0)
    add("--quick", action="store_true", help="a smoke run: 3 conversations x 2 turns over short histories")
    add("--json", default=None, help="also write the report to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.conversations, args.turns, args.history_tokens, args.answer_tokens = 3, 2, 80, 4
        args.rate, args.think_seconds, args.kv_cache_memory = 20.0, 0.0, "16MiB"
    args.modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    unknown = [mode for mode in args.modes if mode not in MODES]
    if unknown:
        parser.error(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(MODES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # A SIGTERM (or a SIGINT that a background shell ignores) stops the replicas on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    modes: dict[str, dict] = {}
    tokens_per_word = None
    for mode in args.modes:
        modes[mode], tokens_per_word = asyncio.run(run_mode(args, mode, tokens_per_word))
        print(f"{mode}: {modes[mode]['num_completed']}/{modes[mode]['num_requests']} turns", file=sys.stderr)
    report = build_report(args, modes)
    print_table(report)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
    return 1 if any(row["errors"] for row in modes.values()) else 0


if __name__ == "__main__":
    sys.exit(main())

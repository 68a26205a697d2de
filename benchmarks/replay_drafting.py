"""Drafting policies compared without timing noise: greedy outputs replayed through the proposer.

Under greedy decoding speculation never changes the tokens, only how many steps produce them. So
the outputs of ``bench_speculative.py``'s prompts are generated once (plain engine, batch 1), and
each drafting config is replayed over them offline with the engine's own ``Proposer`` (its
n-gram index or suffix trees, draft budget, acceptance and wake-up rules): each step proposes
its allowance, accepts the drafts the output confirms, and costs ``--step-ms`` plus ``--row-ms``
per draft. Reported per workload and config: the decode speed-up that prices imply, the steps,
draft rows, accepted drafts and steps without any draft. It models batch 1, where every draft
runs (a draft row costs a few percent of a step, less than any chance it is accepted brings);
at batch 8 which drafts run is the step-time decision's, which only ``bench_speculative.py``
measures. The default prices are a batch-1 step of the embedded model at ~1,500 tokens of
context on a 2-vCPU AMD EPYC Zen 4 and what a draft row added there (docs/performance.md).

    .venv/bin/python benchmarks/replay_drafting.py                      # the benchmark's configs
    .venv/bin/python benchmarks/replay_drafting.py --configs '[{"method": "ngram", "prompt_lookup_min": 2}]'
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import bench_speculative  # benchmarks/, beside this script

from kunlun_runtime import LLM, SamplingParams
from kunlun_runtime.config import SpeculativeConfig
from kunlun_runtime.engine.request import Request
from kunlun_runtime.engine.spec_propose import Proposer


@dataclass(frozen=True, slots=True)
class Replay:
    speedup: float  # plain decode time / speculative decode time, at the given prices
    steps: int
    draft_rows: int
    accepted: int
    steps_without_drafts: int


def replay(
    config: SpeculativeConfig,
    sequences: Sequence[tuple[list[int], list[int]]],
    step_ms: float,
    row_ms: float,
) -> Replay:
    """Decode each (prompt, greedy output) again with ``config``'s drafts, one request at a time:
    the output's first token came with the prompt's prefill, each step after it emits the drafts
    the output confirms and the token after them."""
    proposer = Proposer(config)
    plain_ms = spec_ms = 0.0
    steps = rows = accepted_total = without = 0
    for index, (prompt, output) in enumerate(sequences):
        request = Request(
            f"replay-{index}",
            list(prompt),
            SamplingParams(temperature=0),
            max_total_tokens=len(prompt) + len(output),
        )
        request.output_token_ids = list(output[:1])
        position = 1
        plain_ms += step_ms * (len(output) - 1)
        while position < len(output):
            drafts = proposer.drafts(request, proposer.allowance(request, len(output) - position - 1))
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == output[position + accepted]:
                accepted += 1
            if drafts:
                proposer.accepted(request.request_id, len(drafts), accepted)
            else:
                without += 1
            steps, rows, accepted_total = steps + 1, rows + len(drafts), accepted_total + accepted
            spec_ms += step_ms + row_ms * len(drafts)
            position += accepted + 1
            request.output_token_ids = list(output[:position])
        proposer.forget(request)
    return Replay(plain_ms / spec_ms if spec_ms else 1.0, steps, rows, accepted_total, without)


def greedy_outputs(llm: LLM, conversations, max_tokens: int) -> list[tuple[list[int], list[int]]]:
    tokenizer = llm.engine.tokenizer
    prompts = [
        tokenizer.encode(text, add_special_tokens=False)
        for text in bench_speculative.prompt_texts(tokenizer, conversations)
    ]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    return [
        (prompt, list(output.outputs[0].token_ids)) for prompt, output in zip(prompts, outputs, strict=True)
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="HF-format model directory (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--step-ms", type=float, default=15.7, help="a plain decode step")
    parser.add_argument("--row-ms", type=float, default=0.65, help="what one draft row adds to it")
    parser.add_argument(
        "--configs",
        type=json.loads,
        default=list(bench_speculative.SPECS.values()),
        help="a JSON list of speculative configs (default: the benchmark's)",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: short prompts and outputs")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    scale, max_model_len = (0.025, None) if args.quick else (1.0, 4096)
    max_tokens = 8 if args.quick else args.max_tokens
    configs = [SpeculativeConfig(**config) for config in args.configs]
    llm = LLM(args.model, dtype=args.dtype, max_model_len=max_model_len, enable_prefix_caching=False)
    workloads = {
        "copy": bench_speculative.copy_tasks(8, scale),
        "free": bench_speculative.free_tasks(8),
    }
    sequences = {name: greedy_outputs(llm, tasks, max_tokens) for name, tasks in workloads.items()}
    llm.close()
    print(f"prices: a plain step {args.step_ms} ms, a draft row {args.row_ms} ms")
    for name, outputs in sequences.items():
        for config, given in zip(configs, args.configs, strict=True):
            result = replay(config, outputs, args.step_ms, args.row_ms)
            print(
                f"{name} {json.dumps(given)}: {result.speedup:.2f}x, {result.steps} steps, "
                f"{result.draft_rows} draft rows, {result.accepted} accepted, "
                f"{result.steps_without_drafts} steps without drafts"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Drafting policies compared without timing noise: greedy outputs replayed through the engine's
speculative decoder.

Under greedy decoding speculation never changes the tokens, only how many steps produce them. So
the outputs of ``bench_speculative.py``'s prompts are generated once (plain engine, ``--batch``
prompts at a time, as the benchmark's closed batches run them), and each drafting config is
replayed over them offline, ``--batch`` prompts decoding together as in the benchmark: each step
the engine's own ``SpeculativeDecoder`` proposes (its n-gram index or suffix trees, draft
budgets, acceptance, wake-up rule, and its choice of how many drafts the step runs, priced by the
steps it has observed), the drafts the output confirms are accepted, and the step is priced by a
linear model: ``--step-ms`` for a step of one request, ``--request-ms`` for each further request
decoding in it, ``--row-ms`` per draft row (several: each replayed over the same outputs); the
decoder observes that price as the engine observes its forward's time. Reported per workload and
config: the decode speed-up that prices imply, the steps, draft rows, accepted drafts and steps
without any draft, and the *oracle*: the same proposals with exactly the drafts that will be
accepted run, the ceiling of any step decision at those prices.

The default prices are those of the embedded model at ~1,500 tokens of context on a 2-vCPU AMD
EPYC Zen 4 (docs/performance.md): a batch-1 step, what each further decoding request added at
batch 8, and what a draft row added at batch 1. A draft row's price depends on the batch (beside
one decode row it rides on a memory-bound read of the weights; beside eight the linears are
compute-bound): pass the price measured at the batch replayed.

    .venv/bin/python benchmarks/replay_drafting.py                      # the benchmark's configs
    .venv/bin/python benchmarks/replay_drafting.py --batch 8 --row-ms 1.6
    .venv/bin/python benchmarks/replay_drafting.py --step-ms 15.5 --row-ms 2.3 1.3 0.5  # cheaper rows
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
from kunlun_runtime.engine.spec_decode import SpeculativeDecoder
from kunlun_runtime.engine.spec_verify import accept_greedy
from kunlun_runtime.engine.step_cost import StepCostModel, StepFeatures, decode_features
from kunlun_runtime.layers.cpu_kernels import MAX_ROWS


@dataclass(frozen=True, slots=True)
class StepPrices:
    """Modelled milliseconds of a decode step: ``step_ms`` with one decoding request,
    ``request_ms`` per further one, ``row_ms`` per draft row."""

    step_ms: float
    request_ms: float
    row_ms: float

    def step(self, requests: int, draft_rows: int) -> float:
        return self.step_ms + self.request_ms * (requests - 1) + self.row_ms * draft_rows


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
    prices: StepPrices,
    batch: int = 1,
    *,
    oracle: bool = False,
    in_flight: bool = False,
) -> Replay:
    """Decode the (prompt, greedy output) pairs again with ``config``'s drafts, ``batch`` at a time
    in lockstep: each output's first token came with its prompt's prefill, each step after it
    emits the drafts the output confirms and the token after them, and a request leaves its
    batch when its output is complete. A batch is closed (the next ``batch`` pairs start when
    its last request has left; the speed-up is over all steps) or, ``in_flight``, refilled from
    the pairs left as soon as a request leaves (a server's continuous batching with ``batch``
    requests in flight; the speed-up is over the steps with all ``batch`` decoding, at least
    ``batch`` pairs needed). ``oracle``: each request runs exactly those of its proposer's drafts
    that will be accepted, up to the configured maximum, while the step's rows last (taken in
    the batch's order)."""
    if in_flight and len(sequences) < batch:
        raise ValueError(f"{batch} requests in flight need at least {batch} prompts, got {len(sequences)}")
    decoder = SpeculativeDecoder(config, eos_token_ids=())
    cost = StepCostModel()  # fitted on the modelled steps, as the engine's on its steps
    queue = list(enumerate(sequences))
    requests: dict[str, tuple[Request, list[int]]] = {}
    plain_ms = spec_ms = full_ms = 0.0
    steps = rows = accepted_total = without = full_tokens = 0
    while queue or requests:
        if in_flight or not requests:
            admitted = []
            while queue and len(requests) < batch:
                index, (prompt, output) = queue.pop(0)
                request = Request(
                    f"replay-{index}",
                    list(prompt),
                    SamplingParams(temperature=0),
                    max_total_tokens=len(prompt) + len(output),
                )
                request.output_token_ids = list(output[:1])
                request.num_computed_tokens = request.num_tokens - 1
                requests[request.request_id] = (request, output)
                admitted.append(len(output) - 1)
            if not in_flight:  # the same batch without drafts: a step while any still decodes
                for step in range(max(admitted)):
                    plain_ms += prices.step(sum(1 for left in admitted if left > step), 0)
        running = [request for request, _ in requests.values()]
        if oracle:
            spare = MAX_ROWS - len(running)  # the step's rows, shared as the engine shares them
            for request, output in requests.values():
                spare -= _oracle_drafts(decoder, request, output, spare)
        else:
            decoder.propose(running, MAX_ROWS, cost, lambda _request_id: None)
        draft_rows = sum(len(request.spec_token_ids) for request in running)
        step_ms = prices.step(len(running), draft_rows)
        decoder.price.observe(frozenset(requests), draft_rows, step_ms / 1000)
        features = sum(
            (decode_features(r.num_computed_tokens, len(r.spec_token_ids)) for r in running),
            StepFeatures(),
        )
        cost.observe(features, step_ms / 1000)  # what the scheduler reports of the step
        steps, rows, spec_ms = steps + 1, rows + draft_rows, spec_ms + step_ms
        without += draft_rows == 0
        full = len(running) == batch
        for request, output in list(requests.values()):
            drafts, position = request.spec_token_ids, len(request.output_token_ids)
            # The greedy output is the model's choice at each position: verified as the engine does.
            tokens, accepted = accept_greedy(output[position:], drafts)
            if drafts:
                decoder.proposer.accepted(request.request_id, len(drafts), accepted)
            accepted_total += accepted
            full_tokens += len(tokens) if full else 0
            request.output_token_ids = list(output[: position + len(tokens)])
            request.num_computed_tokens = request.num_tokens - 1
            request.spec_token_ids.clear()
            if request.num_tokens == request.max_total_tokens:
                decoder.forget(request)
                del requests[request.request_id]
        full_ms += step_ms if full else 0.0
    if in_flight:  # tokens per millisecond with the batch full, against a full batch's plain step
        speedup = (full_tokens / full_ms) / (batch / prices.step(batch, 0)) if full_ms else 1.0
    else:
        speedup = plain_ms / spec_ms if spec_ms else 1.0
    return Replay(speedup, steps, rows, accepted_total, without)


def _oracle_drafts(decoder: SpeculativeDecoder, request: Request, output: list[int], spare: int) -> int:
    """``request``'s drafts that the output confirms, of its proposer's longest proposal within
    ``spare`` rows; returns how many."""
    position = len(request.output_token_ids)
    room = min(decoder.proposer.config.num_speculative_tokens, len(output) - position - 1, spare)
    drafts = decoder.proposer.drafts(request, room)
    _, accepted = accept_greedy(output[position:], drafts)
    request.spec_token_ids[:] = drafts[:accepted]
    return accepted


def greedy_outputs(
    llm: LLM, conversations, max_tokens: int, batch: int = 1
) -> list[tuple[list[int], list[int]]]:
    """Each prompt's greedy output, generated ``batch`` prompts at a time as the benchmark runs
    them: prompts prefilled together share PyTorch's matrix multiplies, whose rows' bits follow
    the step's other rows, so a prompt's output alone can differ from its output beside others,
    and a replay must draft over the text the benchmark will decode."""
    tokenizer = llm.engine.tokenizer
    prompts = [
        tokenizer.encode(text, add_special_tokens=False)
        for text in bench_speculative.prompt_texts(tokenizer, conversations)
    ]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = []
    for start in range(0, len(prompts), batch):
        outputs.extend(llm.generate(prompts[start : start + batch], params))
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
    parser.add_argument("--batch", type=int, default=1, help="prompts decoding together")
    parser.add_argument(
        "--in-flight",
        action="store_true",
        help="keep --batch requests in flight (a request leaving is replaced at once) rather than closed batches",
    )
    parser.add_argument("--prompts", type=int, default=8, help="prompts per workload")
    parser.add_argument("--step-ms", type=float, default=15.7, help="a decode step of one request")
    parser.add_argument(
        "--request-ms", type=float, default=1.94, help="what each further decoding request adds to it"
    )
    parser.add_argument(
        "--row-ms",
        type=float,
        nargs="+",
        default=[0.65],
        help="what one draft row adds to it; several: each replayed over the same outputs",
    )
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
        "copy": bench_speculative.copy_tasks(args.prompts, scale),
        "free": bench_speculative.free_tasks(args.prompts),
    }
    sequences = {
        name: greedy_outputs(llm, tasks, max_tokens, args.batch) for name, tasks in workloads.items()
    }
    llm.close()
    for row_ms in args.row_ms:
        prices = StepPrices(args.step_ms, args.request_ms, row_ms)
        print(
            f"batch {args.batch}{' in flight' if args.in_flight else ''}, {args.prompts} prompts; "
            f"prices: a step of one request {prices.step_ms} ms, each further request "
            f"{prices.request_ms} ms, a draft row {prices.row_ms} ms"
        )
        for name, outputs in sequences.items():
            for config, given in zip(configs, args.configs, strict=True):
                result = replay(config, outputs, prices, args.batch, in_flight=args.in_flight)
                ceiling = replay(config, outputs, prices, args.batch, oracle=True, in_flight=args.in_flight)
                print(
                    f"{name} {json.dumps(given)}: {result.speedup:.2f}x, {result.steps} steps, "
                    f"{result.draft_rows} draft rows, {result.accepted} accepted, "
                    f"{result.steps_without_drafts} steps without drafts; oracle {ceiling.speedup:.2f}x, "
                    f"{ceiling.steps} steps, {ceiling.draft_rows} draft rows"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())

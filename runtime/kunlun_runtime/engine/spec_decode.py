"""Speculative decoding without a second model: propose drafts on the host, verify them in the step.

A decoding request's drafts (``ngram``: the tokens that followed the first occurrence of its last
n tokens, prompt and output alike; ``suffix``: the likeliest continuation of its longest matching
suffix in suffix trees of its own tokens and of its tenant's earlier outputs, ``suffix_cache``)
are computed in the same forward as its last token, so one step yields the logits of every draft
position. Verification keeps the output exactly that of decoding without drafts:

- greedy: a draft is accepted while it equals the model's choice at its position; the first
  mismatch is replaced by the model's choice, and when every draft is accepted the model's next
  token is added ("bonus");
- sampling: the proposer's distribution is a point mass on the draft (q = 1), so the draft is
  accepted with probability p(draft) and, when rejected, the token is drawn from p with the draft
  removed and renormalised (the residual max(p - q, 0) of speculative sampling); the accepted run,
  its replacement or the bonus are then distributed exactly as sequential sampling from p.

Each position's p is the request's own (penalties over the tokens accepted before it, min_tokens,
temperature, top-k/p, min-p); its seeded generator draws the acceptance tests and the tokens in
order, so a seed reproduces (``spec_verify``). The KV of rejected positions is never counted as
computed: their blocks' hashes are never made, and blocks made only for them go back to the pool
(the engine). How many drafts a request proposes follows its recent acceptance, and how many of
all of them a step runs follows what drafts were measured to add to a step (``draft_price``; the
step-time model before that, ``spec_propose``), so text with nothing to copy pays for a draft
only now and then. A request with a structured-output constraint drafts
only what its grammar accepts, and each of its positions is verified under its grammar's mask
there (``spec_grammar``). This module joins them for the engine and counts (vLLM's counters).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kunlun_runtime.config import SpeculativeConfig
from kunlun_runtime.engine.draft_price import DraftRowPrice
from kunlun_runtime.engine.logprobs import TokenLogprob
from kunlun_runtime.engine.request import Request
from kunlun_runtime.engine.sampler import AllowedTokens, Sampler, plain_greedy
from kunlun_runtime.engine.scheduler_output import SchedulerOutput
from kunlun_runtime.engine.spec_grammar import grammar_drafts, masked_logits
from kunlun_runtime.engine.spec_propose import Proposer, draft_rows_worth_running
from kunlun_runtime.engine.spec_verify import accept_greedy, verify
from kunlun_runtime.engine.step_cost import StepCostModel
from kunlun_runtime.structured.grammar import GrammarMatcher


@dataclass(slots=True)
class SpecDecodeCounters:
    """vLLM's speculative-decoding counters (``vllm:spec_decode_*``)."""

    num_drafts: int = 0  # steps in which a request was verified with drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # position i: drafts accepted there

    def totals(self) -> tuple[int, int, int, tuple[int, ...]]:
        return self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, tuple(self.accepted_per_pos)

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < proposed:
            self.accepted_per_pos.extend([0] * (proposed - len(self.accepted_per_pos)))
        for position in range(accepted):
            self.accepted_per_pos[position] += 1


REFUSAL_STEPS = 8  # steps a refusal to draft stands for while nothing it depends on changed


class SpeculativeDecoder:
    """The engine's speculative side: drafts before a step, verification after it."""

    def __init__(self, config: SpeculativeConfig, eos_token_ids: Sequence[int]) -> None:
        self.proposer = Proposer(config)
        self.eos_token_ids = list(eos_token_ids)
        self.counters = SpecDecodeCounters()
        self.price = DraftRowPrice()
        # The last refusal to draft: the decoding requests and their allowances, and the steps
        # it still stands for (see propose).
        self._refused: tuple[tuple[tuple[str, int], ...], int] | None = None

    def propose(
        self,
        running: Sequence[Request],
        max_rows: int,
        cost: StepCostModel,
        grammar_of: Callable[[str], GrammarMatcher | None],
    ) -> None:
        """Drafts for the running requests about to decode (their last token not computed yet):
        each proposes up to its budget (a constrained request's, ``grammar_of`` its grammar's
        state, only as far as its grammar accepts them), and the step runs the likeliest of all
        of them, as many as make the step's tokens per second highest by what adjacent steps of
        these requests measured (``draft_price``), else by the engine's step-time model
        (``cost``), and the decode rows stay within ``max_rows`` (a decode step of more rows
        leaves the small-batch kernels for the large-batch matmuls)."""
        decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        spare = max_rows - len(decoding)
        for request in running:
            request.spec_token_ids.clear()
        allowed = [
            self.proposer.allowance(request, min(request.max_total_tokens - request.num_tokens - 1, spare))
            for request in decoding  # room after the next token
        ]
        # When not even every allowed draft at its best chance would pay for its row, none is
        # proposed (a suffix tree walk per request per step, for nothing, cost free text at batch
        # 8 a few percent). A refusal stands for REFUSAL_STEPS steps of the same requests and
        # allowances: their chances change only when drafts are verified, which a refusal
        # prevents, and the step-time model by a few steps' observations; deciding again each
        # step cost 1-2 % of a batch-8 step.
        situation = tuple((r.request_id, k) for r, k in zip(decoding, allowed, strict=True))
        if self._refused is not None and self._refused[0] == situation and self._refused[1] > 0:
            self._refused = (situation, self._refused[1] - 1)
            return
        self._refused = None
        hoped = sorted(
            (
                self.proposer.best_chance(r.request_id, p)
                for r, k in zip(decoding, allowed, strict=True)
                for p in range(k)
            ),
            reverse=True,
        )
        del hoped[max(spare, 0) :]  # no more drafts than the step's rows can take
        batch = frozenset(r.request_id for r in decoding)
        measured = self.price.series(batch, len(hoped))
        if draft_rows_worth_running(cost, decoding, hoped, measured) == 0:
            if any(allowed):
                self._refused = (situation, REFUSAL_STEPS - 1)
            return
        proposals = [
            grammar_drafts(grammar_of(request.request_id), self.proposer.drafts(request, k))
            for request, k in zip(decoding, allowed, strict=True)
        ]
        # Every draft by its chance, likeliest first; a request's own in order (its chances fall).
        candidates = sorted(
            (
                (self.proposer.chance(request.request_id, position), position, index)
                for index, (request, drafts) in enumerate(zip(decoding, proposals, strict=True))
                for position in range(len(drafts))
            ),
            key=lambda candidate: (-candidate[0], candidate[1]),
        )
        del candidates[max(spare, 0) :]  # the step's rows: no more drafts than that can run
        run = draft_rows_worth_running(cost, decoding, [candidate[0] for candidate in candidates], measured)
        if self.price.wants_probe(batch, run):  # unpriced, as many drafts step after step: half
            run -= max(1, run // 2)
        counts = [0] * len(decoding)
        for _, _, index in candidates[:run]:
            counts[index] += 1
        for request, drafts, count in zip(decoding, proposals, counts, strict=True):
            request.spec_token_ids.extend(drafts[:count])

    def sample(
        self,
        sampler: Sampler,
        logits: torch.Tensor,
        counts: Sequence[int],
        requests: Sequence[Request],
        allowed: AllowedTokens | None,
    ) -> list[list[tuple[int, TokenLogprob | None]]]:
        """Each request's tokens from its rows of ``logits`` (``counts[i]`` rows: 1 + drafts):
        the sampler's batch for requests without drafts, ``verify`` for the others; every row of
        a constrained request first masked by ``allowed`` (its rows index those of ``logits``)."""
        if all(count == 1 for count in counts):  # no drafts this step: the plain engine's sampling
            return [[result] for result in sampler.sample(logits, requests, allowed)]
        logits = masked_logits(sampler, logits, allowed)
        offsets = [0]
        for count in counts:
            offsets.append(offsets[-1] + count)
        # Plain greedy requests, with drafts or without, take their tokens from one argmax over
        # every row; the others without drafts sample as the plain engine does.
        fast = {i for i, request in enumerate(requests) if plain_greedy(request)}
        choices = sampler.argmax(logits).tolist() if fast else []
        plain = [i for i, count in enumerate(counts) if count == 1 and i not in fast]
        results: list[list[tuple[int, TokenLogprob | None]]] = [
            [(choices[offsets[i]], None)] if i in fast and count == 1 else []
            for i, count in enumerate(counts)
        ]
        if plain:
            rows = torch.tensor([offsets[i] for i in plain], dtype=torch.long, device=logits.device)
            sampled = sampler.sample(logits.index_select(0, rows), [requests[i] for i in plain])
            for i, result in zip(plain, sampled, strict=True):
                results[i] = [result]
        for i, count in enumerate(counts):
            if count == 1:
                continue
            request = requests[i]
            drafts = request.spec_token_ids[: count - 1]
            emitted: list[tuple[int, TokenLogprob | None]]
            if i in fast:
                tokens, accepted = accept_greedy(choices[offsets[i] : offsets[i + 1]], drafts)
                emitted = [(token, None) for token in tokens]
            else:
                emitted, accepted = verify(
                    logits[offsets[i] : offsets[i + 1]],
                    request,
                    drafts,
                    self.eos_token_ids,
                    sampler.generator(request),
                )
            self.counters.record(len(drafts), accepted)
            self.proposer.accepted(request.request_id, len(drafts), accepted)
            results[i] = emitted
        return results

    def observe(self, sched: SchedulerOutput, seconds: float) -> None:
        """The step ``sched`` took ``seconds`` (its forward): a pure decode step prices drafts."""
        if sched.features.num_prefill_tokens == 0 and sched.scheduled:
            batch = frozenset(item.request.request_id for item in sched.scheduled)
            self.price.observe(batch, sched.features.num_draft_rows, seconds)

    def forget(self, request: Request) -> None:
        """``request`` finished (its output complete)."""
        self.proposer.forget(request)

"""Speculative decoding without a second model: propose drafts on the host, verify them in the step.

A decoding request's drafts (``ngram``: the tokens that followed the latest earlier occurrence of
its last n tokens, prompt and output alike) are computed in the same forward as its last token,
so one step yields the logits of every draft position. Verification keeps the output exactly that
of decoding without drafts:

- greedy: a draft is accepted while it equals the model's choice at its position; the first
  mismatch is replaced by the model's choice, and when every draft is accepted the model's next
  token is added ("bonus");
- sampling: the proposer's distribution is a point mass on the draft (q = 1), so the draft is
  accepted with probability p(draft) and, when rejected, the token is drawn from p with the draft
  removed and renormalised (the residual max(p - q, 0) of speculative sampling); the accepted run,
  its replacement or the bonus are then distributed exactly as sequential sampling from p.

Each position's p is the request's own (penalties over the tokens accepted before it, min_tokens,
temperature, top-k/p, min-p); its seeded generator draws the acceptance tests and the tokens in
order, so a seed reproduces. The KV of rejected positions is simply not counted: their blocks'
hashes are never made, and the next step writes over them. How many drafts a request gets follows
its recent acceptance (``DraftBudget``), so text with nothing to copy pays for at most one draft.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kunlun_runtime.config import SpeculativeConfig
from kunlun_runtime.engine.logprobs import TokenLogprob
from kunlun_runtime.engine.request import Request
from kunlun_runtime.engine.sampler import (
    AllowedTokens,
    Sampler,
    apply_penalties,
    make_logprob,
    suppress_stop_tokens,
    truncate_distribution,
)


def propose_ngram(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the last n tokens of
    ``tokens``, for the largest n in [min_n, max_n] that occurs; [] when none does."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = list(tokens[length - n :])
        for start in range(length - n - 1, -1, -1):  # latest first; the suffix itself excluded
            if tokens[start] == suffix[0] and list(tokens[start : start + n]) == suffix:
                follow = list(tokens[start + n : start + n + k])
                if follow:
                    return follow
    return []


@dataclass(slots=True)
class DraftBudget:
    """How many drafts a request gets: starts at the configured maximum, halves after a step that
    accepted none, grows by one after a step that accepted all."""

    maximum: int
    current: int = 0

    def __post_init__(self) -> None:
        self.current = self.current or self.maximum

    def update(self, proposed: int, accepted: int) -> None:
        if proposed and accepted == 0:
            self.current = max(1, self.current // 2)
        elif proposed and accepted == proposed:
            self.current = min(self.maximum, self.current + 1)


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


class Proposer:
    """Drafts for the running requests about to decode, within their budgets and lengths."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._budgets: dict[str, DraftBudget] = {}

    def propose(self, request: Request, room: int) -> list[int]:
        """``request``'s drafts for its next step (``room``: tokens it may still add after the
        next one). Requests with a grammar or prompt logprobs do not speculate."""
        if request.params.structured_outputs is not None or room <= 0:
            return []
        budget = self._budgets.setdefault(request.request_id, DraftBudget(self.config.num_speculative_tokens))
        k = min(budget.current, room)
        config = self.config
        return propose_ngram(request.all_token_ids, k, config.prompt_lookup_min, config.prompt_lookup_max)

    def accepted(self, request_id: str, proposed: int, accepted: int) -> None:
        budget = self._budgets.get(request_id)
        if budget is not None:
            budget.update(proposed, accepted)

    def forget(self, request_id: str) -> None:
        self._budgets.pop(request_id, None)


def verify(
    logits: torch.Tensor,
    request: Request,
    drafts: Sequence[int],
    eos_token_ids: Sequence[int],
    generator: torch.Generator,
) -> tuple[list[tuple[int, TokenLogprob | None]], int]:
    """The tokens ``request`` emits from FP32 ``logits`` [len(drafts) + 1, V] (row i: the
    distribution after the i-th draft) and how many drafts it accepted. The request's own output
    is extended position by position while deciding (penalties and min_tokens see the accepted
    drafts) and restored before returning."""
    params = request.params
    outputs = request.output_token_ids
    original_length = len(outputs)
    emitted: list[tuple[int, TokenLogprob | None]] = []
    accepted = 0
    try:
        for position in range(len(drafts) + 1):
            row = logits[position : position + 1].clone()
            raw = torch.log_softmax(row[0], dim=-1) if params.logprobs is not None else None
            apply_penalties(row, [request])
            suppress_stop_tokens(row, [request], eos_token_ids)
            draft = drafts[position] if position < len(drafts) else None
            if params.greedy:
                token = int(torch.argmax(row[0]))
                take_draft = draft is not None and token == draft
            else:
                probs = truncate_distribution(row[0], params)
                take_draft = draft is not None and float(torch.rand((), generator=generator)) < float(
                    probs[draft]
                )
                if take_draft and draft is not None:
                    token = draft
                else:
                    if draft is not None:  # the residual: p without the rejected draft
                        probs = probs.clone()
                        probs[draft] = 0.0
                        probs = probs / probs.sum()
                    token = int(torch.multinomial(probs.cpu(), 1, generator=generator))
            emitted.append((token, None if raw is None else make_logprob(raw, token, params.logprobs or 0)))
            outputs.append(token)
            if not take_draft:
                break
            accepted += 1
    finally:
        del outputs[original_length:]
    return emitted, accepted


class SpeculativeDecoder:
    """The engine's speculative side: drafts before a step, verification after it."""

    def __init__(self, config: SpeculativeConfig, eos_token_ids: Sequence[int]) -> None:
        self.proposer = Proposer(config)
        self.eos_token_ids = list(eos_token_ids)
        self.counters = SpecDecodeCounters()

    def propose(self, running: Sequence[Request]) -> None:
        """Drafts for every running request about to decode (its last token not computed yet)."""
        for request in running:
            request.spec_token_ids.clear()
            if request.num_tokens - request.num_computed_tokens == 1:
                room = request.max_total_tokens - request.num_tokens - 1  # after the next token
                request.spec_token_ids.extend(self.proposer.propose(request, room))

    def sample(
        self,
        sampler: Sampler,
        logits: torch.Tensor,
        counts: Sequence[int],
        requests: Sequence[Request],
        allowed: AllowedTokens | None,
    ) -> list[list[tuple[int, TokenLogprob | None]]]:
        """Each request's tokens from its rows of ``logits`` (``counts[i]`` rows: 1 + drafts):
        the sampler's batch for requests without drafts, ``verify`` for the others."""
        offsets = [0]
        for count in counts:
            offsets.append(offsets[-1] + count)
        plain = [i for i, count in enumerate(counts) if count == 1]
        results: list[list[tuple[int, TokenLogprob | None]]] = [[] for _ in requests]
        if plain:
            rows = torch.tensor([offsets[i] for i in plain], dtype=torch.long, device=logits.device)
            if allowed is not None:  # its rows count requests; only requests without drafts have one
                allowed = AllowedTokens(tuple(plain.index(row) for row in allowed.rows), allowed.bitmask)
            sampled = sampler.sample(logits.index_select(0, rows), [requests[i] for i in plain], allowed)
            for i, result in zip(plain, sampled, strict=True):
                results[i] = [result]
        for i, count in enumerate(counts):
            if count == 1:
                continue
            request = requests[i]
            drafts = request.spec_token_ids[: count - 1]
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

    def forget(self, request_id: str) -> None:
        self.proposer.forget(request_id)

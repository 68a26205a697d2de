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
order, so a seed reproduces. The KV of rejected positions is simply not counted: their blocks'
hashes are never made, and the next step writes over them. How many drafts a request gets follows
its recent acceptance (``DraftBudget``), so text with nothing to copy pays for at most one draft.
A request with a structured-output constraint drafts only what its grammar accepts, and each of its
positions is verified under its grammar's mask there (``spec_grammar``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
from kunlun_runtime.engine.spec_grammar import grammar_drafts, masked_logits
from kunlun_runtime.engine.step_cost import StepCostModel, StepFeatures, chunk_features
from kunlun_runtime.engine.suffix_cache import SuffixCache, SuffixIndex, SuffixParams, tenant_of
from kunlun_runtime.structured.grammar import GrammarMatcher


def propose_ngram(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the first occurrence of the last n tokens of ``tokens``
    (the suffix itself excluded), for the largest n in [min_n, max_n] that occurs; [] when none
    does. The first, not the latest: a text being copied is in the prompt, before the output's
    own repeats (on copy tasks it accepted 0.67 of its drafts against 0.52 with the latest)."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = list(tokens[length - n :])
        for start in range(length - n):
            if tokens[start] == suffix[0] and list(tokens[start : start + n]) == suffix:
                follow = list(tokens[start + n : start + n + k])
                if follow:
                    return follow
    return []


class NgramIndex:
    """Where each n-gram (n in [min_n, max_n]) of a request's tokens first occurs, extended as its
    tokens grow, so a proposal is a few dictionary lookups rather than a scan of the context."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._first: dict[tuple[int, ...], int] = {}  # n-gram → the position just after its first occurrence
        self._indexed = 0  # tokens whose n-grams ending there are in the index

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """``propose_ngram(tokens, k, min_n, max_n)``, from the index."""
        length = len(tokens)
        # The suffix's own occurrence must not count: index every n-gram ending before the last token.
        for end in range(max(self._indexed, 1), length):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._first.setdefault(tuple(tokens[end - n : end]), end)
        self._indexed = max(self._indexed, length)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            after = self._first.get(tuple(tokens[length - n :]))
            if after is not None and after < length:
                return list(tokens[after : after + k])
        return []


@dataclass(slots=True)
class DraftBudget:
    """How many drafts a request gets: starts at the configured maximum, halves after a step that
    accepted none (down to none at all), grows by one after a step that accepted all. At none it
    rests ``REST_STEPS`` steps, then probes with one draft: text with nothing to copy pays for a
    draft only now and then."""

    REST_STEPS = 8
    maximum: int
    current: int = -1
    resting: int = 0

    def __post_init__(self) -> None:
        if self.current < 0:
            self.current = self.maximum

    def next(self) -> int:
        """Drafts for the next step."""
        if self.current == 0:
            self.resting += 1
            if self.resting >= self.REST_STEPS:
                self.resting, self.current = 0, 1
        return self.current

    def update(self, proposed: int, accepted: int) -> None:
        if proposed and accepted == 0:
            self.current //= 2
        elif proposed and accepted == proposed:
            self.current = min(self.maximum, self.current + 1)


def draft_rows_worth_running(
    cost: StepCostModel, decoding: Sequence[Request], chances: Sequence[float]
) -> int:
    """How many of the step's candidate drafts (their chances of acceptance, likeliest first) to
    run: the count that makes the most expected tokens per second of the step, by the engine's
    online step-time model; every one until that model has seen decode steps of two sizes (which
    drafting itself makes). A whole count is chosen, not a price per row, because a row's price
    is not the same everywhere: on a CPU whose linears read the weights once per pass of 8 rows,
    the first row of a new pass costs several rows' time and only pays with enough likely drafts
    after it; rows are cheap at batch 1 and nearly a token's time each at batch 8."""
    if not chances or not decoding or not cost.knows_decode_rows():
        return len(chances)
    features = StepFeatures()
    for request in decoding:
        features = features + chunk_features(request.num_tokens - 1, 1)
    longest = max(request.num_tokens for request in decoding)
    seconds = cost.predict(features)
    if seconds is None or seconds <= 0:
        return len(chances)
    best, best_rate = 0, len(decoding) / seconds
    expected = float(len(decoding))
    for count, chance in enumerate(chances, 1):
        expected += chance
        features = features + chunk_features(longest, 1)
        seconds = cost.predict(features)
        if seconds is not None and seconds > 0 and expected / seconds > best_rate:
            best, best_rate = count, expected / seconds
    return best


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


INITIAL_ACCEPTANCE = 0.6  # a request's acceptance rate before its first verification
ACCEPTANCE_MEMORY = 0.8  # weight of the past in a request's acceptance rate


class Proposer:
    """Drafts for the running requests about to decode, within their budgets and lengths, and
    only as many as their recent acceptance makes worth this step's cost."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._budgets: dict[str, DraftBudget] = {}
        self._acceptance: dict[str, float] = {}  # per request: accepted / drafted, recent steps weighted
        self._indexes: dict[str, NgramIndex | SuffixIndex] = {}
        # suffix: its settings, and the tenants' outputs its drafts may also come from (None
        # under ngram, or with suffix_decoding_max_cached_requests 0)
        self._suffix = SuffixParams.from_config(config) if config.method == "suffix" else None
        self._suffix_cache = (
            SuffixCache(self._suffix.max_tree_depth, self._suffix.max_cached_requests)
            if self._suffix is not None and self._suffix.max_cached_requests > 0
            else None
        )

    def propose(self, request: Request, room: int) -> list[int]:
        """``request``'s drafts for its next step, at most its budget and ``room`` (tokens it may
        still add after the next one, and the step's rows left for drafts). How many of them
        the step runs is the caller's choice (``chance``, ``draft_rows_worth_running``). A
        constrained request's drafts are cut to its grammar by the caller
        (``spec_grammar.grammar_drafts``)."""
        if room <= 0:
            return []
        budget = self._budgets.setdefault(request.request_id, DraftBudget(self.config.num_speculative_tokens))
        k = min(budget.next(), room)
        if k == 0:
            return []
        index = self._indexes.get(request.request_id)
        if index is None:
            index = self._indexes[request.request_id] = self._new_index(request)
        return index.propose(request.all_token_ids, k)

    def chance(self, request_id: str, position: int) -> float:
        """The chance that the request's draft at ``position`` (0: the first) is accepted: its
        recent acceptance rate to the power of the drafts up to it."""
        return self._acceptance.get(request_id, INITIAL_ACCEPTANCE) ** (position + 1)

    def _new_index(self, request: Request) -> NgramIndex | SuffixIndex:
        """The method's index of ``request``'s tokens: its n-grams' first occurrences, or its suffix
        tree beside its tenant's cached outputs."""
        if self._suffix is not None:
            return SuffixIndex(self._suffix, self._suffix_cache, tenant_of(request))
        low, high = self.config.prompt_lookup_min, self.config.prompt_lookup_max
        assert low is not None and high is not None  # an ngram SpeculativeConfig has both
        return NgramIndex(low, high)

    def accepted(self, request_id: str, proposed: int, accepted: int) -> None:
        budget = self._budgets.get(request_id)
        if budget is not None:
            budget.update(proposed, accepted)
        if proposed:
            rate = self._acceptance.get(request_id, INITIAL_ACCEPTANCE)
            self._acceptance[request_id] = (
                ACCEPTANCE_MEMORY * rate + (1 - ACCEPTANCE_MEMORY) * accepted / proposed
            )

    def forget(self, request: Request) -> None:
        """Drop finished ``request``'s state; under suffix its output joins its tenant's cache."""
        self._budgets.pop(request.request_id, None)
        self._acceptance.pop(request.request_id, None)
        self._indexes.pop(request.request_id, None)
        if self._suffix_cache is not None:
            self._suffix_cache.add(tenant_of(request), request.output_token_ids)


def plain_greedy(request: Request) -> bool:
    """Whether ``request``'s choice at every position is the argmax of its raw logits (greedy, no
    penalties, no min_tokens to hold, no logprobs to report): its drafts verify in one batched
    argmax with the others'."""
    params = request.params
    return (
        params.greedy
        and params.logprobs is None
        and params.repetition_penalty == 1.0
        and not params.presence_penalty
        and not params.frequency_penalty
        and len(request.output_token_ids) >= params.min_tokens
    )


def accept_greedy(choices: Sequence[int], drafts: Sequence[int]) -> tuple[list[int], int]:
    """The tokens a plain greedy request emits given the model's choice at each position (after
    its last token and after each draft): the drafts it agrees with, then its own choice."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == choices[accepted]:
        accepted += 1
    return [*drafts[:accepted], choices[accepted]], accepted


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
        of them, as many as make the step's tokens per second highest by the engine's step-time
        model (``cost``) and the decode rows stay within ``max_rows`` (a decode step of more rows
        leaves the small-batch kernels for the large-batch matmuls)."""
        decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        spare = max_rows - len(decoding)
        for request in running:
            request.spec_token_ids.clear()
        proposals = []
        for request in decoding:
            room = min(request.max_total_tokens - request.num_tokens - 1, spare)  # after the next token
            proposals.append(
                grammar_drafts(grammar_of(request.request_id), self.proposer.propose(request, room))
            )
        # Every draft by its chance, likeliest first; a request's own in order (its chances fall).
        candidates = sorted(
            (
                (self.proposer.chance(request.request_id, position), position, index)
                for index, (request, drafts) in enumerate(zip(decoding, proposals, strict=True))
                for position in range(len(drafts))
            ),
            key=lambda candidate: (-candidate[0], candidate[1]),
        )
        run = min(max(spare, 0), draft_rows_worth_running(cost, decoding, [c[0] for c in candidates]))
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
        logits = masked_logits(sampler, logits, allowed)
        offsets = [0]
        for count in counts:
            offsets.append(offsets[-1] + count)
        plain = [i for i, count in enumerate(counts) if count == 1]
        results: list[list[tuple[int, TokenLogprob | None]]] = [[] for _ in requests]
        if plain:
            rows = torch.tensor([offsets[i] for i in plain], dtype=torch.long, device=logits.device)
            sampled = sampler.sample(logits.index_select(0, rows), [requests[i] for i in plain])
            for i, result in zip(plain, sampled, strict=True):
                results[i] = [result]
        fast = {i for i, count in enumerate(counts) if count > 1 and plain_greedy(requests[i])}
        choices = sampler.argmax(logits).tolist() if fast else []  # one pass over every row
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

    def forget(self, request: Request) -> None:
        """``request`` finished (its output complete)."""
        self.proposer.forget(request)

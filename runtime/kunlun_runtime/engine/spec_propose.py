"""Speculative decoding's proposing side: what each decoding request drafts and how many of
all the drafts a step runs.

``ngram`` drafts come from an index of the first occurrences of a request's n-grams, ``suffix``
drafts from ``suffix_cache``'s trees; a request drafts up to its budget, which follows its
acceptance (``DraftBudget``), and the step runs the likeliest drafts of all its requests, as many
as its step-time model says raise the step's tokens per second (``draft_rows_worth_running``).
Must not: verify drafts or touch logits (``spec_verify``), or know the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kunlun_runtime.config import SpeculativeConfig
from kunlun_runtime.engine.request import Request
from kunlun_runtime.engine.step_cost import StepCostModel, StepFeatures, chunk_features, draft_row_features
from kunlun_runtime.engine.suffix_cache import SuffixCache, SuffixIndex, SuffixParams, tenant_of
from kunlun_runtime.engine.suffix_tree import NO_DRAFT, Draft


def propose_ngram(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> Draft:
    """Up to ``k`` tokens that followed the first occurrence of the last n tokens of ``tokens``
    (the suffix itself excluded), for the largest n in [min_n, max_n] that occurs, with n as its
    match length and the position they follow from as its source; no draft when none does. The
    first, not the latest: a text being copied is in the prompt, before the output's own repeats
    (on copy tasks it accepted 0.67 of its drafts against 0.52 with the latest)."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = list(tokens[length - n :])
        for start in range(length - n):
            if tokens[start] == suffix[0] and list(tokens[start : start + n]) == suffix:
                follow = tuple(tokens[start + n : start + n + k])
                if follow:
                    return Draft(follow, match_length=n, source=start + n)
    return NO_DRAFT


class NgramIndex:
    """Where each n-gram (n in [min_n, max_n]) of a request's tokens first occurs, extended as its
    tokens grow, so a proposal is a few dictionary lookups rather than a scan of the context."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._first: dict[tuple[int, ...], int] = {}  # n-gram → the position just after its first occurrence
        self._indexed = 0  # tokens whose n-grams ending there are in the index

    def propose(self, tokens: Sequence[int], k: int) -> Draft:
        """``propose_ngram(tokens, k, min_n, max_n)``, from the index."""
        length = len(tokens)
        if not self._first:  # a request's first proposal: its whole prompt at once
            self._index_all(tokens)
        # The suffix's own occurrence must not count: index every n-gram ending before the last token.
        for end in range(max(self._indexed, 1), length):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._first.setdefault(tuple(tokens[end - n : end]), end)
        self._indexed = max(self._indexed, length)
        # Where the shortest suffix never occurred before, no longer one did (each occurrence of a
        # longer one ends with it): most steps of text with nothing to copy stop at one lookup.
        shortest = self._first.get(tuple(tokens[length - self.min_n :])) if length > self.min_n else None
        if shortest is None or shortest >= length:
            return NO_DRAFT
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            after = self._first.get(tuple(tokens[length - n :]))
            if after is not None and after < length:
                return Draft(tuple(tokens[after : after + k]), match_length=n, source=after)
        return NO_DRAFT

    def _index_all(self, tokens: Sequence[int]) -> None:
        """Index every n-gram of ``tokens`` ending before the last token, as ``propose``'s loop does,
        a whole n at a time: a 1,600-token prompt took 1.7-2.3 ms in that loop, inside the decode
        step in which its request first drafted, and half of that here."""
        length = len(tokens)
        for n in range(self.min_n, self.max_n + 1):
            starts = length - n  # n-grams at 0 .. starts - 1, ending at n .. length - 1
            if starts <= 0:
                break
            grams = list(zip(*(tokens[i : i + starts] for i in range(n)), strict=True))
            # Of a repeated key, update keeps the last value: walked backwards, the first occurrence's.
            self._first.update(zip(reversed(grams), range(length - 1, n - 1, -1), strict=True))
        self._indexed = length


@dataclass(slots=True)
class DraftBudget:
    """How many drafts a request gets: starts at the configured maximum, halves after a step that
    accepted none (down to none at all), returns to the maximum after a step that accepted all.
    At none it rests ``REST_STEPS`` steps, then probes with one draft: text with nothing to copy
    pays for a draft only now and then. ``wake`` ends a rest early (the proposer's evidence that
    drafting pays again). A step that accepts every draft is a copy resumed; climbing back one
    draft a step cut the copy's next runs short, and the step's pricing still decides how many
    of the maximum run (docs/performance.md: 7 Dec 2026, late morning)."""

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

    def wake(self) -> int:
        """Probe with one draft now, resting or not; returns the drafts for the next step."""
        self.resting, self.current = 0, max(self.current, 1)
        return self.current

    def update(self, proposed: int, accepted: int) -> None:
        if proposed and accepted == 0:
            self.current //= 2
        elif proposed and accepted == proposed:
            self.current = self.maximum


DRAFT_MARGIN = 0.05  # the predicted gain in tokens per second a step's drafts must bring


def draft_rows_worth_running(
    cost: StepCostModel,
    decoding: Sequence[Request],
    chances: Sequence[float],
    measured: Sequence[float] | None = None,
) -> int:
    """How many of the step's candidate drafts (their chances of acceptance, likeliest first) to
    run: the count that makes the most expected tokens per second of the step, by the engine's
    online step-time model; every one until that model has seen decode steps of two sizes (which
    drafting itself makes). A whole count is chosen, not a price per row, because a row's price
    is not the same everywhere: where the linears read the weights once per pass of a fixed
    number of rows, the first row of a new pass costs several rows' time and only pays with enough
    likely drafts after it. A draft row is priced as draft rows were measured (its attention
    re-reads its decode row's keys, ``draft_row_features``), not as a decode row. Drafts are run
    only for a predicted gain of at least ``DRAFT_MARGIN``. ``measured``: the step's seconds with
    0, 1, … drafts as adjacent steps of these requests measured them (``draft_price``), used
    instead of the model where given."""
    if not chances or not decoding:
        return len(chances)
    series: Sequence[float] | None
    if measured is not None and len(measured) > len(chances):
        series = measured[: len(chances) + 1]
    else:
        if not cost.knows_decode_rows():
            return len(chances)
        features = StepFeatures()
        for request in decoding:
            features = features + chunk_features(request.num_tokens - 1, 1)
        longest = max(request.num_tokens for request in decoding)
        series = cost.predict_adding(features, draft_row_features(longest), len(chances))
    if series is None or series[0] <= 0:
        return len(chances)
    plain_rate = len(decoding) / series[0]
    best, best_rate = 0, plain_rate
    expected = float(len(decoding))
    for count, (chance, seconds) in enumerate(zip(chances, series[1:], strict=True), 1):
        expected += chance
        if seconds > 0 and expected / seconds > best_rate:
            best, best_rate = count, expected / seconds
    # The chances are estimates (recent acceptance) and the times a fit: a predicted gain within
    # their error is as likely a loss, and a loss is what speculation must not bring.
    return best if best_rate >= (1 + DRAFT_MARGIN) * plain_rate else 0


INITIAL_ACCEPTANCE = 0.6  # the chance of a draft assumed before any verification
ACCEPTANCE_MEMORY = 0.8  # per step: weight of the past in a request's acceptance
PRIOR_MEMORY = 0.95  # per verification: weight of the past in the acceptance across requests
PRIOR_TESTS = 4.0  # how many tested drafts the prior counts as in a new request's acceptance
LONGEST_MATCH = 16  # drafts from longer matches pool their acceptance with those from this long
# How a draft's acceptance is pooled across requests (Proposer.draft_kind): ("copy", 1) a copied
# draft that continues its request's copy, ("copy", 0) one from a new match, ("match", n) a draft
# from elsewhere by its match length n.
DraftKind = tuple[str, int]
NO_KIND: DraftKind = ("match", 0)
WAKE_MATCH = 3  # a resting request drafts again once its last this many tokens occurred before


@dataclass(slots=True)
class Acceptance:
    """The chance that a draft is accepted given that the drafts before it were, estimated from
    the drafts verification tested: a step that accepts ``a`` of its ``k`` drafts tested ``a + 1``
    of them (the first rejection ends the run; the drafts after it say nothing) or all ``k``.
    Accepted over *proposed* drafts would count the untested ones as failures and understate it
    the more, the more drafts a request proposes. Both counts decay by ``memory`` per update, so
    recent steps weigh more."""

    accepted: float
    tested: float
    memory: float

    @classmethod
    def starting_at(cls, rate: float, tests: float, memory: float) -> Acceptance:
        return cls(rate * tests, tests, memory)

    @property
    def rate(self) -> float:
        return self.accepted / self.tested

    def update(self, proposed: int, accepted: int) -> None:
        self.accepted = self.memory * self.accepted + accepted
        self.tested = self.memory * self.tested + min(proposed, accepted + 1)


class Proposer:
    """Drafts for the running requests about to decode, within their budgets and lengths, and
    only as many as their chances make worth this step's cost.

    A draft's chance is its request's recent acceptance, lowered where drafts of its kind do worse
    across requests (``draft_kind``): a draft copied from the request's own tokens (``ngram``)
    either continues the copy its request's drafts last came from, or starts from a new match (the
    request left the text it copied: an edit, a new field), and the latter fail far more often; a
    suffix draft by its match length (one that follows 1 matched token is accepted far less often
    than one that follows 8). Only lowered: raising it as well predicted acceptance better on our
    workloads, but ran more of free text's drafts at batch 8, where they cost more than they
    brought."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._budgets: dict[str, DraftBudget] = {}
        self._acceptance: dict[str, Acceptance] = {}  # per request, recent steps weighted
        # Across requests, recent verifications weighted: where a new request starts, so a workload
        # whose drafts mostly fail (free text) does not try each new request at an optimistic rate.
        self._prior = Acceptance.starting_at(INITIAL_ACCEPTANCE, PRIOR_TESTS, PRIOR_MEMORY)
        self._by_kind: dict[DraftKind, Acceptance] = {}  # across requests, by draft_kind
        self._kinds: dict[str, DraftKind] = {}  # the kind of each request's latest drafts
        self._copy_distance: dict[str, int] = {}  # how far behind its end each request last copied from
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
        return self.drafts(request, self.allowance(request, room))

    def allowance(self, request: Request, room: int) -> int:
        """How many drafts ``request`` may propose this step: its budget (advanced by one step),
        at most ``room``. Call once per step."""
        if room <= 0:
            return 0
        budget = self._budgets.get(request.request_id)
        if budget is None:
            budget = self._budgets[request.request_id] = DraftBudget(self.config.num_speculative_tokens)
        allowed = budget.next()
        # A request resting after failed drafts (it left the text it copied: an edit, a new
        # field) is woken by a match of WAKE_MATCH tokens or more: on copy tasks that means it
        # copies again, drafts after such a match are mostly accepted, and resting through it
        # cost more steps than failed probes did (docs/performance.md). The step-time model
        # still decides whether the draft runs; a lookup per resting request is the price.
        if allowed == 0 and self._index(request).propose(request.all_token_ids, 1).match_length >= WAKE_MATCH:
            allowed = budget.wake()
        return min(allowed, room)

    def drafts(self, request: Request, k: int) -> list[int]:
        """Up to ``k`` drafts for ``request`` from its index (its tokens so far)."""
        if k <= 0:
            return []
        tokens = request.all_token_ids
        draft = self._index(request).propose(tokens, k)
        self._kinds[request.request_id] = self.draft_kind(request.request_id, draft, len(tokens))
        return list(draft.token_ids)

    def draft_kind(self, request_id: str, draft: Draft, length: int) -> DraftKind:
        """Which drafts across requests ``draft`` (proposed after ``length`` tokens) pools its
        acceptance with. A copied draft continues its request's copy where it comes from as far
        behind the request's end as its last copied drafts did: a request copying a text keeps
        that distance, however many of its tokens came from drafts, and leaving the text (an
        edit, a new field, a rejected draft) moves its next match elsewhere, where drafts fail
        more often (docs/performance.md: copy tasks, 8 in flight)."""
        if draft.source < 0:
            return ("match", min(draft.match_length, LONGEST_MATCH))
        distance = length - draft.source
        continues = self._copy_distance.get(request_id) == distance
        self._copy_distance[request_id] = distance
        return ("copy", int(continues))

    def chance(self, request_id: str, position: int) -> float:
        """The chance that the request's latest draft at ``position`` (0: the first) is accepted:
        its acceptance (a draft's chance after accepted ones), lowered halfway towards that of
        drafts of its kind (``draft_kind``) where those do worse, to the power of the drafts up
        to it."""
        own = self._request_rate(request_id)
        pool = self._by_kind.get(self._kinds.get(request_id, NO_KIND), self._prior)
        return ((own + min(own, pool.rate)) / 2) ** (position + 1)

    def best_chance(self, request_id: str, position: int) -> float:
        """``chance`` for a draft not proposed yet: at least what its chance will be once proposed."""
        return self._request_rate(request_id) ** (position + 1)

    def _request_rate(self, request_id: str) -> float:
        acceptance = self._acceptance.get(request_id)
        return acceptance.rate if acceptance is not None else self._prior.rate

    def _index(self, request: Request) -> NgramIndex | SuffixIndex:
        index = self._indexes.get(request.request_id)
        if index is None:
            index = self._indexes[request.request_id] = self._new_index(request)
        return index

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
            acceptance = self._acceptance.get(request_id)
            if acceptance is None:
                acceptance = self._acceptance[request_id] = Acceptance.starting_at(
                    self._prior.rate, PRIOR_TESTS, ACCEPTANCE_MEMORY
                )
            acceptance.update(proposed, accepted)
            kind = self._kinds.get(request_id, NO_KIND)
            if kind not in self._by_kind:
                self._by_kind[kind] = Acceptance.starting_at(self._prior.rate, PRIOR_TESTS, PRIOR_MEMORY)
            self._by_kind[kind].update(proposed, accepted)
            self._prior.update(proposed, accepted)

    def forget(self, request: Request) -> None:
        """Drop finished ``request``'s state; under suffix its output joins its tenant's cache."""
        self._budgets.pop(request.request_id, None)
        self._acceptance.pop(request.request_id, None)
        self._indexes.pop(request.request_id, None)
        self._kinds.pop(request.request_id, None)
        self._copy_distance.pop(request.request_id, None)
        if self._suffix_cache is not None:
            self._suffix_cache.add(tenant_of(request), request.output_token_ids)

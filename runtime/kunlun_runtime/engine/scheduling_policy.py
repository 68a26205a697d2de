"""Scheduling policies: the batch decisions that differ between ``fixed`` and ``feedback``.

The scheduler owns memory, priority order and preemption; a policy answers only how large each
chunk may be this step, how waiting requests of equal priority are ranked, and whether a waiting
request may be overtaken. ``fixed`` fills the token budget; ``feedback`` also bounds the step's
predicted time, so that decodes keep a steady pace while long prompts are prefilled.

Pure: a policy reads a ``StepCostModel`` (fed by the scheduler from the engine's measured step
times) and optionally a utilisation reader; it never touches torch, the clock or the block pool.
Invariant: every cap it returns lets a step make progress (at least ``min_prefill_chunk`` prefill
tokens when the batch has none yet), so the time target can slow a request down but never stop it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kunlun_runtime.engine.request import Request
from kunlun_runtime.engine.step_cost import StepCostModel, StepFeatures, batch_features, chunk_features
from kunlun_runtime.kv.kv_manager import KVManager


class SchedulingPolicyName(enum.StrEnum):
    FIXED = "fixed"
    FEEDBACK = "feedback"


# With no explicit target, a step that carries decodes may take this many pure-decode steps: the
# inter-token latency a running request sees at most triples while prompts are being prefilled...
DEFAULT_TARGET_DECODE_STEPS = 3.0
# ...or, where a step with any prefill has a fixed price (``c_mixed``: the per-layer path instead
# of the one-call decode stack), the pure-decode step plus this many times that price, so that a
# capped chunk's own work is at least four times the price (prefill at >= 80 % of its uncapped
# efficiency). With three decode steps alone, capped chunks were spent mostly on the price: prefill
# slowed down enough to lose throughput and p99 TTFT under load (docs/scheduling.md).
DEFAULT_TARGET_MIXED_PRICES = 5.0
# ...and never below this (at this bound a stream still gets about three tokens a second while
# prompts are prefilled). The two learned terms above move with every refit of the step-time
# model; on the document QA benchmark they alone won in one seeded run and lost in the other,
# while this bound as an explicit target won both (docs/scheduling.md).
DEFAULT_MIN_TARGET_SECONDS = 0.3
# A small request (whole prompt in one step) may be merged past the target by this fraction: its
# cost is mostly the step's fixed overhead, which it shares with the batch.
MERGE_SLACK_RATIO = 0.5
# Below this utilisation the device idles between steps: any request that fits is merged.
UNDERUSED_UTILIZATION_RATIO = 0.5
DEFAULT_MIN_PREFILL_CHUNK = 16
# The largest chunk the amortization rule may demand (the token budget caps it anyway).
AMORTIZE_LIMIT = 1 << 20
# A request that does not fit may be overtaken by small ones for at most this many of its waiting
# steps (or priority_aging_steps, if fewer); then it blocks the queue as under the fixed policy.
MAX_OVERTAKEN_STEPS = 16


@dataclass(frozen=True, slots=True)
class AdmissionChunk:
    """How much of a waiting request's prompt to admit this step."""

    num_new_tokens: int  # 0: nothing of it fits this step
    whole: bool  # the whole remaining prompt: small enough to pass a request that waits for memory


class SchedulingPolicy(Protocol):
    """What the scheduler asks its policy while it builds a step (in this order)."""

    name: SchedulingPolicyName

    def begin_step(self, running: Sequence[Request]) -> None:
        """A new step starts with ``running`` (in rank order) before anything is scheduled."""
        ...

    def running_chunk(self, request: Request, num_new: int, budget: int) -> int:
        """Tokens a running request computes this step, at most ``num_new``; 0 = none this step."""
        ...

    def note_running(self, request: Request, num_new: int) -> None:
        """A running request was scheduled with ``num_new`` tokens."""
        ...

    def waiting_rank(self, kv: KVManager, request: Request) -> int:
        """Order among waiting requests of equal protection and aged priority (lower first)."""
        ...

    def admission_chunk(self, num_cached_tokens: int, num_remaining: int, budget: int) -> AdmissionChunk:
        """How much of a waiting request (``num_remaining`` tokens after its cached prefix) to admit."""
        ...

    def may_be_overtaken(self, request: Request) -> bool:
        """Whether requests behind this one may be admitted while it waits for memory."""
        ...

    def note_admitted(self, request: Request, num_new: int) -> None:
        """A waiting request was admitted with ``num_new`` tokens."""
        ...

    def forget(self, request_id: str) -> None:
        """Drop what is remembered about a request that left the queue."""
        ...


class FixedPolicy:
    """Fill the token budget in rank order; the first waiting request that does not fit stops
    admission, so nobody overtakes a request that waits for memory."""

    name = SchedulingPolicyName.FIXED

    def begin_step(self, running: Sequence[Request]) -> None:
        pass

    def running_chunk(self, request: Request, num_new: int, budget: int) -> int:
        return num_new

    def note_running(self, request: Request, num_new: int) -> None:
        pass

    def waiting_rank(self, kv: KVManager, request: Request) -> int:
        return 0

    def admission_chunk(self, num_cached_tokens: int, num_remaining: int, budget: int) -> AdmissionChunk:
        return AdmissionChunk(min(num_remaining, budget), num_remaining <= budget)

    def may_be_overtaken(self, request: Request) -> bool:
        return False

    def note_admitted(self, request: Request, num_new: int) -> None:
        pass

    def forget(self, request_id: str) -> None:
        pass


@dataclass(slots=True)
class _StepPlan:
    """The feedback policy's running account of one step being built."""

    target: float | None  # seconds this step may take; None = uncapped
    num_decodes_left: int  # decodes not yet scheduled: the token budget kept for them
    batch: StepFeatures  # predicted composition: every running decode, plus what is scheduled


class FeedbackPolicy:
    """Time-aware batch decisions on top of the scheduler's token and memory limits: while decodes
    run, prefill chunks are capped so the predicted step stays under the target and a token is kept
    for each decode ranked below a prefill; small waiting requests are merged when the step has
    room; requests with more blocks resident in the prefix cache go first among equals; and a
    request waiting for memory may be overtaken by small ones for a bounded number of steps."""

    name = SchedulingPolicyName.FEEDBACK

    def __init__(
        self,
        cost: StepCostModel,
        target_step_seconds: float | None = None,
        utilization: Callable[[], float | None] | None = None,
        min_prefill_chunk: int = DEFAULT_MIN_PREFILL_CHUNK,
        priority_aging_steps: int = MAX_OVERTAKEN_STEPS,
    ) -> None:
        self.cost = cost
        self.target_step_seconds = target_step_seconds
        self.utilization = utilization
        self.min_prefill_chunk = min_prefill_chunk
        self.max_overtaken_steps = min(priority_aging_steps, MAX_OVERTAKEN_STEPS)
        self._hashes: dict[str, tuple[int, list[int]]] = {}  # request id → (tokens hashed, hashes)
        self._plan = _StepPlan(None, 0, StepFeatures())

    # The scheduler's questions (SchedulingPolicy).

    def begin_step(self, running: Sequence[Request]) -> None:
        decodes = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        decode_features = batch_features((r.num_computed_tokens, 1) for r in decodes)
        self._plan = _StepPlan(self.step_target(decode_features), len(decodes), decode_features)

    def running_chunk(self, request: Request, num_new: int, budget: int) -> int:
        """A running prefill's chunk: within the step-time target, leaving a token for each decode."""
        if request.num_tokens - request.num_computed_tokens == 1:
            return num_new
        plan = self._plan
        budget_left = max(0, budget - plan.num_decodes_left)
        return self.prefill_cap(plan.batch, plan.target, request.num_computed_tokens, num_new, budget_left)

    def note_running(self, request: Request, num_new: int) -> None:
        if num_new == request.num_tokens - request.num_computed_tokens == 1:
            self._plan.num_decodes_left -= 1  # its cost is in the plan's batch from the start
        else:
            self._plan.batch = self._plan.batch + chunk_features(request.num_computed_tokens, num_new)

    def waiting_rank(self, kv: KVManager, request: Request) -> int:
        return -self.resident_blocks(kv, request)

    def admission_chunk(self, num_cached_tokens: int, num_remaining: int, budget: int) -> AdmissionChunk:
        plan = self._plan
        whole = num_remaining <= budget and self.can_merge(
            plan.batch, plan.target, num_cached_tokens, num_remaining
        )
        if whole:
            return AdmissionChunk(num_remaining, True)
        return AdmissionChunk(
            self.prefill_cap(plan.batch, plan.target, num_cached_tokens, num_remaining, budget), False
        )

    def may_be_overtaken(self, request: Request) -> bool:
        return not request.protected and request.waited_steps < self.max_overtaken_steps

    def note_admitted(self, request: Request, num_new: int) -> None:
        self._plan.batch = self._plan.batch + chunk_features(request.num_computed_tokens, num_new)
        self.forget(request.request_id)

    # The decisions behind them (pure functions of the step-cost model).

    def step_target(self, decodes: StepFeatures) -> float | None:
        """Seconds a step carrying ``decodes`` may take; None = no cap (no decode is waiting on it,
        or nothing has been measured yet)."""
        if decodes.num_decode_seqs == 0:
            return None
        if self.target_step_seconds is not None:
            return self.target_step_seconds
        predicted = self.cost.predict(decodes)
        if predicted is None or self.cost.coefficients is None:
            return None
        c_mixed = self.cost.coefficients[4]
        return max(
            DEFAULT_TARGET_DECODE_STEPS * predicted,
            predicted + DEFAULT_TARGET_MIXED_PRICES * c_mixed,
            DEFAULT_MIN_TARGET_SECONDS,
        )

    def prefill_cap(
        self, batch: StepFeatures, target: float | None, num_computed: int, num_remaining: int, budget: int
    ) -> int:
        """The largest chunk of a prefill (``num_remaining`` tokens left after ``num_computed``)
        that keeps the predicted step time of ``batch`` plus the chunk within ``target``.

        Never more than ``budget`` tokens; when ``batch`` holds no prefill yet, at least
        ``min_prefill_chunk`` (or what is left), so that prefills always progress, and at least
        enough tokens that the chunk's own work pays the fixed price of a step with prefill
        (``amortized_chunk``); 0 when the step is full.
        """
        limit = min(num_remaining, budget)
        if limit <= 0 or target is None or self.cost.coefficients is None:
            return max(limit, 0)
        floor = 0
        if batch.num_prefill_tokens == 0:
            floor = min(limit, max(self.min_prefill_chunk, self.amortized_chunk()))
        if self._predict(batch, num_computed, limit) <= target:
            return limit
        low, high = floor, limit  # invariant: low fits (or is the floor), high does not
        while high - low > 1:
            middle = (low + high) // 2
            if self._predict(batch, num_computed, middle) <= target:
                low = middle
            else:
                high = middle
        return low

    def amortized_chunk(self) -> int:
        """Prefill tokens whose work equals the fixed price of leaving the pure-decode path
        (``c_mixed / c_prefill``): a smaller chunk would spend most of its step on that price."""
        coefficients = self.cost.coefficients
        if coefficients is None:
            return 0
        c_prefill, c_mixed = coefficients[1], coefficients[4]
        if c_mixed <= 0.0:
            return 0
        return AMORTIZE_LIMIT if c_prefill <= 0.0 else min(AMORTIZE_LIMIT, round(c_mixed / c_prefill))

    def can_merge(
        self, batch: StepFeatures, target: float | None, num_computed: int, num_tokens: int
    ) -> bool:
        """Whether a small request's whole prefill fits into this step: within the target plus the
        merge slack, or on a device that reports it is under-used."""
        if target is None:
            return True
        utilization = self.utilization() if self.utilization is not None else None
        if utilization is not None and utilization < UNDERUSED_UTILIZATION_RATIO:
            return True
        return self._predict(batch, num_computed, num_tokens) <= target * (1.0 + MERGE_SLACK_RATIO)

    def _predict(self, batch: StepFeatures, num_computed: int, num_new: int) -> float:
        predicted = self.cost.predict(batch + chunk_features(num_computed, num_new))
        return 0.0 if predicted is None else predicted

    def resident_blocks(self, kv: KVManager, request: Request) -> int:
        """How many of the request's leading full blocks are in the prefix cache now (the same
        match as ``KVManager.find_cached_prefix``, without counting it as a cache query)."""
        num_hashed, hashes = self._hashes.get(request.request_id, (-1, []))
        if num_hashed != request.num_tokens:
            hashes = kv.prefix_hashes(request)
            self._hashes[request.request_id] = (request.num_tokens, hashes)
        return kv.num_cached_blocks(hashes)

    def forget(self, request_id: str) -> None:
        """Drop what is remembered about a finished request."""
        self._hashes.pop(request_id, None)


def build_policy(
    name: SchedulingPolicyName | str,
    cost: StepCostModel,
    *,
    target_step_seconds: float | None = None,
    utilization: Callable[[], float | None] | None = None,
    priority_aging_steps: int = MAX_OVERTAKEN_STEPS,
) -> SchedulingPolicy:
    """The policy called ``name``; raises ValueError for an unknown one (config validates first)."""
    match SchedulingPolicyName(name):
        case SchedulingPolicyName.FIXED:
            return FixedPolicy()
        case SchedulingPolicyName.FEEDBACK:
            return FeedbackPolicy(
                cost, target_step_seconds, utilization, priority_aging_steps=priority_aging_steps
            )

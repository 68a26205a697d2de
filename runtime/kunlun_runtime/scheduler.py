"""Continuous batching: which requests run this step, with how many tokens, and who is preempted.

Policy (pure; no model, no tensors):
1. Running requests first (decodes and unfinished prefill chunks), in priority order: protected
   requests, then lower ``priority`` value, then earlier arrival.
2. When a running request needs a block and none is free, the lowest-ranked unprotected running
   request is preempted (recompute: its blocks are freed, it returns to waiting). A request
   preempted ``max_preemptions`` times becomes protected: it is never preempted again and, when
   re-admitted, reserves blocks for its whole remaining length so it can always finish (the
   seed's third lesson: unbounded preemption livelocked long requests).
3. Then waiting requests, in order: protected first, then effective priority (``priority`` minus
   one level per ``priority_aging_steps`` steps waited, so nobody starves), then arrival. Admission
   stops at the first request that does not fit: nobody overtakes a request that waits for memory.
4. Everything under ``max_num_batched_tokens`` tokens and ``max_num_seqs`` sequences; a prompt
   longer than the remaining budget is prefilled in chunks over several steps.

That is the ``fixed`` policy. The ``feedback`` policy (seed §3.3.1; decisions in
``scheduling_policy``) keeps rules 1–4 and the same preemption and protection, and adds time: a
``StepCostModel`` learns step seconds from the engine's ``observe_step`` and, while decodes run,
prefill chunks are capped so the predicted step stays under the target; the token budget is kept
for the decodes ranked below a prefill; small waiting requests (whole prompt in one step) are merged
when the step has room; among waiting requests of equal effective priority those with more blocks
resident in the prefix cache go first; and a request waiting for memory may be overtaken by small
requests that fit, during at most ``MAX_OVERTAKEN_STEPS`` (16; or ``priority_aging_steps`` if
fewer) of its waiting steps, and never when it is protected.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kunlun_runtime.config import EngineConfig
from kunlun_runtime.kv.kv_manager import KVManager
from kunlun_runtime.request import Request, RequestStatus
from kunlun_runtime.scheduling_policy import MAX_OVERTAKEN_STEPS, FeedbackPolicy
from kunlun_runtime.step_cost import StepCostModel, StepFeatures, batch_features, chunk_features


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this step, starting at request.num_computed_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # running ones first, then new
    preempted: list[Request] = field(default_factory=list)  # preempted this step
    num_batched_tokens: int = 0
    features: StepFeatures = field(default_factory=StepFeatures)  # composition, for the step-time model

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_preemptions: int
    priority_aging_steps: int
    scheduling_policy: str = "fixed"  # "fixed" | "feedback"
    target_step_seconds: float | None = None  # feedback: step-time cap while decodes run

    @classmethod
    def from_config(cls, config: EngineConfig) -> SchedulerLimits:
        return cls(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_preemptions=config.max_preemptions,
            priority_aging_steps=config.priority_aging_steps,
            scheduling_policy=config.scheduling_policy,
            target_step_seconds=config.target_step_seconds,
        )


@dataclass(slots=True)
class _StepPlan:
    """The feedback policy's running account of one step being built."""

    target: float | None  # seconds this step may take; None = uncapped
    num_decodes_left: int  # decodes not yet scheduled: the token budget kept for them
    batch: StepFeatures  # predicted composition: every running decode, plus what is scheduled


class Scheduler:
    def __init__(
        self, limits: SchedulerLimits, kv: KVManager, utilization: Callable[[], float | None] | None = None
    ) -> None:
        """``utilization`` reads the device's utilisation ratio (None where unknown); feedback only."""
        self.limits = limits
        self.kv = kv
        self.cost = StepCostModel()
        self.policy: FeedbackPolicy | None = None
        if limits.scheduling_policy == "feedback":
            self.policy = FeedbackPolicy(self.cost, limits.target_step_seconds, utilization)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.step_index = 0
        self.num_preemptions_total = 0
        self.last_step_seconds: float | None = None
        self.last_step_tokens = 0

    def add(self, request: Request) -> None:
        request.arrival_step = self.step_index
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def _running_key(self, request: Request) -> tuple:
        return (not request.protected, request.priority, request.arrival_step, request.request_id)

    def _waiting_key(self, request: Request) -> tuple:
        aged = request.priority - request.waited_steps // self.limits.priority_aging_steps
        return (not request.protected, aged, request.arrival_step, request.request_id)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.limits.max_num_batched_tokens
        self.running.sort(key=self._running_key)
        plan = None
        if self.policy is not None:
            decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
            decode_features = batch_features((r.num_computed_tokens, 1) for r in decodes)
            plan = _StepPlan(self.policy.step_target(decode_features), len(decodes), decode_features)
        budget = self._schedule_running(out, budget, plan)
        if plan is None:
            self._admit_waiting(out, budget)
        else:
            self._admit_waiting_feedback(out, budget, plan)
        for request in self.waiting:
            request.waited_steps += 1
        out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
        out.features = batch_features(
            (s.request.num_computed_tokens, s.num_new_tokens) for s in out.scheduled
        )
        self.step_index += 1
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, plan: _StepPlan | None) -> int:
        """Running requests in rank order; returns the token budget left."""
        scheduled_ids: set[str] = set()
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if plan is not None:
                num_new = self._feedback_chunk(request, num_new, budget, plan)
                if num_new == 0:  # no time left in this step for its prefill: it keeps its blocks,
                    scheduled_ids.add(request.request_id)  # and lower-ranked ones may not take them
                    index += 1
                    continue
            if self._make_room(request, num_new, scheduled_ids, out):
                out.scheduled.append(ScheduledRequest(request, num_new))
                scheduled_ids.add(request.request_id)
                budget -= num_new
                index += 1
                if plan is not None and num_new == request.num_tokens - request.num_computed_tokens == 1:
                    plan.num_decodes_left -= 1  # its cost is in plan.batch from the start
                elif plan is not None:
                    plan.batch = plan.batch + chunk_features(request.num_computed_tokens, num_new)
            elif request.status is RequestStatus.WAITING:  # it preempted itself
                continue
            else:
                index += 1  # protected and out of memory this step: it keeps its blocks and waits
        return budget

    def _feedback_chunk(self, request: Request, num_new: int, budget: int, plan: _StepPlan) -> int:
        """A running prefill's chunk: within the step-time target, leaving a token for each decode."""
        if request.num_tokens - request.num_computed_tokens == 1:
            return num_new
        assert self.policy is not None
        budget_left = max(0, budget - plan.num_decodes_left)
        return self.policy.prefill_cap(
            plan.batch, plan.target, request.num_computed_tokens, num_new, budget_left
        )

    def _make_room(
        self, request: Request, num_new: int, scheduled_ids: set[str], out: SchedulerOutput
    ) -> bool:
        """Allocate for ``request``, preempting lower-ranked running requests as needed."""
        while not self.kv.allocate(request, num_new):
            victim = next(
                (
                    other
                    for other in reversed(self.running)
                    if other is not request and not other.protected and other.request_id not in scheduled_ids
                ),
                None,
            )
            if victim is None:
                if not request.protected:
                    self._preempt(request, out)
                return False
            self._preempt(victim, out)
        return True

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        self.waiting.sort(key=self._waiting_key)
        admitted = 0
        for request in self.waiting:
            if budget <= 0 or len(self.running) >= self.limits.max_num_seqs:
                break
            cached = self.kv.find_cached_prefix(request)
            num_cached_tokens = len(cached) * self.kv.block_size
            num_new = min(request.num_tokens - num_cached_tokens, budget)
            reserve = 0
            if request.protected:
                reserve = max(0, request.max_total_tokens - num_cached_tokens - num_new)
            if not self.kv.allocate(request, num_new, cached, reserve_tokens=reserve):
                break
            self._start(request, num_cached_tokens, num_new, out)
            budget -= num_new
            admitted += 1
        del self.waiting[:admitted]

    def _admit_waiting_feedback(self, out: SchedulerOutput, budget: int, plan: _StepPlan) -> None:
        """Waiting requests by (protected, aged priority, resident blocks, arrival); small ones may
        be merged past the time target and past a request that waits for memory (bounded)."""
        policy = self.policy
        assert policy is not None
        resident = {r.request_id: policy.resident_blocks(self.kv, r) for r in self.waiting}
        self.waiting.sort(
            key=lambda r: (*self._waiting_key(r)[:2], -resident[r.request_id], *self._waiting_key(r)[2:])
        )
        admitted: set[str] = set()
        blocked = False  # someone ahead was skipped: from here on only small requests are admitted
        for request in self.waiting:
            if budget <= 0 or len(self.running) >= self.limits.max_num_seqs:
                break
            cached = self.kv.find_cached_prefix(request)
            num_cached_tokens = len(cached) * self.kv.block_size
            remaining = request.num_tokens - num_cached_tokens
            small = remaining <= budget and policy.can_merge(
                plan.batch, plan.target, num_cached_tokens, remaining
            )
            num_new = (
                remaining
                if small
                else policy.prefill_cap(plan.batch, plan.target, num_cached_tokens, remaining, budget)
            )
            bound = min(self.limits.priority_aging_steps, MAX_OVERTAKEN_STEPS)
            may_be_overtaken = not request.protected and request.waited_steps < bound
            if blocked and not small:
                continue
            reserve = (
                max(0, request.max_total_tokens - num_cached_tokens - num_new) if request.protected else 0
            )
            if num_new == 0 or not self.kv.allocate(request, num_new, cached, reserve_tokens=reserve):
                if blocked or not may_be_overtaken:
                    break
                blocked = True
                continue
            self._start(request, num_cached_tokens, num_new, out)
            plan.batch = plan.batch + chunk_features(num_cached_tokens, num_new)
            budget -= num_new
            admitted.add(request.request_id)
            policy.forget(request.request_id)
        self.waiting = [r for r in self.waiting if r.request_id not in admitted]

    def _start(self, request: Request, num_cached_tokens: int, num_new: int, out: SchedulerOutput) -> None:
        request.num_computed_tokens = num_cached_tokens
        if request.num_preemptions == 0:
            request.num_cached_prompt_tokens = num_cached_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        out.scheduled.append(ScheduledRequest(request, num_new))

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.kv.free(request)
        self.running.remove(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.protected = request.num_preemptions >= self.limits.max_preemptions
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self.num_preemptions_total += 1
        out.preempted.append(request)

    def observe_step(self, out: SchedulerOutput, elapsed_seconds: float) -> None:
        """Feedback from the engine: how long the model took for this schedule."""
        self.last_step_seconds = elapsed_seconds
        self.last_step_tokens = out.num_batched_tokens
        self.cost.observe(out.features, elapsed_seconds)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Remove a finished or aborted request and return its blocks."""
        request.status = status
        if self.policy is not None:
            self.policy.forget(request.request_id)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)

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
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kunlun_runtime.kv.kv_manager import KVManager
from kunlun_runtime.request import Request, RequestStatus


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this step, starting at request.num_computed_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # running ones first, then new
    preempted: list[Request] = field(default_factory=list)  # preempted this step
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_preemptions: int
    priority_aging_steps: int


class Scheduler:
    def __init__(self, limits: SchedulerLimits, kv: KVManager) -> None:
        self.limits = limits
        self.kv = kv
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
        scheduled_ids: set[str] = set()
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if self._make_room(request, num_new, scheduled_ids, out):
                out.scheduled.append(ScheduledRequest(request, num_new))
                scheduled_ids.add(request.request_id)
                budget -= num_new
                index += 1
            elif request.status is RequestStatus.WAITING:  # it preempted itself
                continue
            else:
                index += 1  # protected and out of memory this step: it keeps its blocks and waits
        self._admit_waiting(out, budget)
        for request in self.waiting:
            request.waited_steps += 1
        out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
        self.step_index += 1
        return out

    def _make_room(self, request: Request, num_new: int, scheduled_ids: set[str], out: SchedulerOutput) -> bool:
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
            request.num_computed_tokens = num_cached_tokens
            if request.num_preemptions == 0:
                request.num_cached_prompt_tokens = num_cached_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
            admitted += 1
        del self.waiting[:admitted]

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

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Remove a finished or aborted request and return its blocks."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)

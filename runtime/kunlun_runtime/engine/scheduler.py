"""Continuous batching: which requests run this step, with how many tokens, and who is preempted.

Policy (pure; no model, no tensors):
1. Running requests first (decodes and unfinished prefill chunks), in priority order: protected
   requests, then lower ``priority`` value, then earlier arrival.
2. When a running request needs a block and none is free, the lowest-ranked unprotected running
   request is preempted (recompute: its blocks are freed, it returns to waiting). A request
   preempted ``max_preemptions`` times becomes protected: it is never preempted again and, when
   re-admitted, reserves blocks for its whole remaining length so it can always finish: without
   that bound, long requests under memory pressure are preempted again and again and never finish.
3. Then waiting requests, in order: protected first, then effective priority (``priority`` minus
   one level per ``priority_aging_steps`` steps waited, so nobody starves), then arrival. Admission
   stops at the first request that does not fit: nobody overtakes a request that waits for memory.
4. Everything under ``max_num_batched_tokens`` tokens and ``max_num_seqs`` sequences; a prompt
   longer than the remaining budget is prefilled in chunks over several steps.
5. With LoRA, the running requests use at most ``max_loras`` adapters (the model's slots): a
   waiting request on another adapter waits, and the requests behind it may pass it, until it has
   waited ``priority_aging_steps`` steps: then no new request joins the running adapters until a
   slot frees.

That is the ``fixed`` policy. The ``feedback`` policy (its decisions live in
``scheduling_policy``) keeps rules 1–4 and the same preemption and protection, and adds time: a
``StepCostModel`` learns step seconds from ``update_from_output`` and, while decodes run,
prefill chunks are capped so the predicted step stays under the target; the token budget is kept
for the decodes ranked below a prefill; small waiting requests (whole prompt in one step) are merged
when the step has room; among waiting requests of equal effective priority those with more blocks
resident in the prefix cache go first; and a request waiting for memory may be overtaken by small
requests that fit, during at most ``MAX_OVERTAKEN_STEPS`` (16; or ``priority_aging_steps`` if
fewer) of its waiting steps, and never when it is protected.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from kunlun_runtime.config import EngineConfig
from kunlun_runtime.engine.request import Request, RequestStatus
from kunlun_runtime.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from kunlun_runtime.engine.scheduling_policy import SchedulingPolicy, SchedulingPolicyName, build_policy
from kunlun_runtime.engine.step_cost import StepCostModel, StepFeatures, chunk_features, decode_features
from kunlun_runtime.kv.kv_manager import KVManager
from kunlun_runtime.lora.request import LoRARequest


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_preemptions: int
    priority_aging_steps: int
    scheduling_policy: SchedulingPolicyName = SchedulingPolicyName.FIXED
    target_step_seconds: float | None = None  # feedback: step-time cap while decodes run
    max_loras: int | None = None  # LoRA adapters one step may use (None: LoRA is off)

    @classmethod
    def from_config(cls, config: EngineConfig) -> SchedulerLimits:
        return cls(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_preemptions=config.max_preemptions,
            priority_aging_steps=config.priority_aging_steps,
            scheduling_policy=SchedulingPolicyName(config.scheduling_policy),
            target_step_seconds=config.target_step_seconds,
            max_loras=config.max_loras if config.enable_lora else None,
        )


class Scheduler:
    def __init__(
        self,
        limits: SchedulerLimits,
        kv: KVManager,
        utilization: Callable[[], float | None] | None = None,
        pass_rows: int | None = None,
    ) -> None:
        """``utilization`` reads the device's utilisation ratio (None where unknown); feedback only.
        ``pass_rows``: the decode rows the model's kernels serve per read of the weights (None:
        no such limit), for the step-time model."""
        self.limits = limits
        self.kv = kv
        self.cost = StepCostModel(pass_rows=pass_rows)
        self.policy: SchedulingPolicy = build_policy(
            limits.scheduling_policy,
            self.cost,
            target_step_seconds=limits.target_step_seconds,
            utilization=utilization,
            priority_aging_steps=limits.priority_aging_steps,
        )
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.step_index = 0
        self._arrivals = itertools.count()
        self.num_preemptions_total = 0
        self.last_step_seconds: float | None = None
        self.last_step_tokens = 0

    def add(self, request: Request) -> None:
        request.arrival_order = next(self._arrivals)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # Ties of priority go by arrival: requests added in the same step by the order they were added
    # (their ids, as strings, put "10" before "2").
    def _running_key(self, request: Request) -> tuple[bool, int, int]:
        return (not request.protected, request.priority, request.arrival_order)

    def _waiting_key(self, request: Request) -> tuple[bool, int, int]:
        aged = request.priority - request.waited_steps // self.limits.priority_aging_steps
        return (not request.protected, aged, request.arrival_order)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.running.sort(key=self._running_key)
        self.policy.begin_step(self.running)
        budget = self._schedule_running(out, self.limits.max_num_batched_tokens)
        self._admit_waiting(out, budget)
        for request in self.waiting:
            request.waited_steps += 1
        out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
        out.features = sum((_features(s) for s in out.scheduled), StepFeatures())
        self.step_index += 1
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Running requests in rank order; returns the token budget left."""
        scheduled_ids: set[str] = set()
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_real = request.num_tokens - request.num_computed_tokens
            num_new = min(num_real + len(request.spec_token_ids), budget)
            num_new = self.policy.running_chunk(request, num_new, budget)
            if num_new < num_real + len(request.spec_token_ids):  # drafts only after the whole rest
                del request.spec_token_ids[max(0, num_new - num_real) :]
            if num_new == 0:  # no time left in this step for its prefill: it keeps its blocks,
                scheduled_ids.add(request.request_id)  # and lower-ranked ones may not take them
                index += 1
                continue
            if self._make_room(request, num_new, scheduled_ids, out):
                out.scheduled.append(ScheduledRequest(request, num_new, len(request.spec_token_ids)))
                scheduled_ids.add(request.request_id)
                budget -= num_new
                index += 1
                self.policy.note_running(request, num_new)
            elif request.status is RequestStatus.WAITING:  # it preempted itself
                continue
            else:
                index += 1  # protected and out of memory this step: it keeps its blocks and waits
        return budget

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
        """Waiting requests by (protected, aged priority, the policy's rank, arrival), until one
        does not fit; the policy may let small requests pass that one for a while."""
        ranks = {r.request_id: self.policy.waiting_rank(self.kv, r) for r in self.waiting}

        def order(request: Request) -> tuple[object, ...]:
            key = self._waiting_key(request)
            return (*key[:2], ranks[request.request_id], *key[2:])

        self.waiting.sort(key=order)
        admitted: set[str] = set()
        blocked = False  # someone ahead was skipped: from here on only whole small requests
        adapters = {r.lora for r in self.running if r.lora is not None}
        draining = self._draining_adapters(adapters)
        for request in self.waiting:
            if budget <= 0 or len(self.running) >= self.limits.max_num_seqs:
                break
            if not self._adapter_fits(request, adapters, draining):  # it waits for a slot; others may pass
                continue
            cached = self.kv.find_cached_prefix(request)
            num_cached_tokens = cached.num_tokens
            chunk = self.policy.admission_chunk(
                num_cached_tokens, request.num_tokens - num_cached_tokens, budget
            )
            if blocked and not chunk.whole:
                continue
            num_new = chunk.num_new_tokens
            reserve = (
                max(0, request.max_total_tokens - num_cached_tokens - num_new) if request.protected else 0
            )
            if num_new == 0 or not self.kv.allocate(request, num_new, cached, reserve_tokens=reserve):
                if blocked or not self.policy.may_be_overtaken(request):
                    break
                blocked = True
                continue
            self._start(request, num_cached_tokens, num_new, out)
            if request.lora is not None:
                adapters.add(request.lora)
            self.policy.note_admitted(request, num_new)
            budget -= num_new
            admitted.add(request.request_id)
        self.waiting = [r for r in self.waiting if r.request_id not in admitted]

    def _adapter_fits(self, request: Request, adapters: set[LoRARequest], draining: bool) -> bool:
        """A request on a LoRA adapter joins the step only while the running requests use fewer
        than ``max_loras`` adapters, or its own is among them (the model has that many slots) and
        no request has waited too long for a slot (``draining``)."""
        if request.lora is None or self.limits.max_loras is None:
            return True
        if request.lora in adapters:
            return not draining
        return len(adapters) < self.limits.max_loras

    def _draining_adapters(self, adapters: set[LoRARequest]) -> bool:
        """Whether a request has waited ``priority_aging_steps`` steps for an adapter slot while
        every slot was busy: then no new request joins the running adapters, so that their
        requests finish and free a slot (a stream of requests on one adapter would otherwise
        keep another adapter out forever)."""
        if self.limits.max_loras is None or len(adapters) < self.limits.max_loras:
            return False
        return any(
            r.lora is not None
            and r.lora not in adapters
            and r.waited_steps >= self.limits.priority_aging_steps
            for r in self.waiting
        )

    def _start(self, request: Request, num_cached_tokens: int, num_new: int, out: SchedulerOutput) -> None:
        request.num_computed_tokens = num_cached_tokens
        if request.num_preemptions == 0:
            request.num_cached_prompt_tokens = num_cached_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        out.scheduled.append(ScheduledRequest(request, num_new))

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        request.spec_token_ids.clear()
        self.kv.free(request)
        self.running.remove(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.protected = request.num_preemptions >= self.limits.max_preemptions
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self.num_preemptions_total += 1
        out.preempted.append(request)

    def update_from_output(self, out: SchedulerOutput, elapsed_seconds: float | None) -> None:
        """Account for a step the model has run: advance each scheduled request's computed tokens,
        register its newly full blocks in the prefix cache, and learn the step's time (None: the
        step was not timed, e.g. a simulation; the step-time model learns nothing from it)."""
        for item in out.scheduled:  # drafts count once accepted (the engine's verification)
            item.request.num_computed_tokens += item.num_new_tokens - item.num_draft_tokens
            self.kv.cache_computed_blocks(item.request)
        self.last_step_tokens = out.num_batched_tokens
        if elapsed_seconds is not None:
            self.last_step_seconds = elapsed_seconds
            self.cost.observe(out.features, elapsed_seconds)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Remove a finished or aborted request and return its blocks."""
        request.status = status
        self.policy.forget(request.request_id)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)


def _features(item: ScheduledRequest) -> StepFeatures:
    """What a scheduled request computes: a decode with drafts runs as one one-token sequence per
    position (the model runner's layout), the rows after the first verifying drafts; anything
    else as one chunk."""
    start = item.request.num_computed_tokens
    if not item.num_draft_tokens:
        return chunk_features(start, item.num_new_tokens)
    return decode_features(start, item.num_new_tokens - 1)

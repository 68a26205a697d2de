"""Turn engine steps into metric observations: counter increments, TTFT/ITL, finished requests.

Runs on the engine thread right after each step (it reads engine counters, which only that thread
changes) and feeds ``kunlun_runtime.metrics.EngineMetrics``. Counters are the differences of the
engine's running totals since the previous call, so a warm-up run before ``reset`` is not counted.

A finished request also reports its parameters, as vLLM observes them: its effective
``max_tokens`` (as asked, or what the context leaves), and, once per API request, its ``n``. The
n engine requests of one API request are named ``<parent>-<index>`` and added together before a
step (``serving.children``), so the first record that sees any of them sees them all: waiting or
running in the scheduler, or finished in that step. A request is learnt there; one that finishes
in its very first step is learnt from its output, where ``max_tokens`` is known only when it
ended by ``length`` (then it is the number of tokens generated) or from a sibling.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from kunlun_runtime.engine.llm_engine import LLMEngine
from kunlun_runtime.engine.outputs import RequestOutput, RequestTimes
from kunlun_runtime.metrics import EngineMetrics, FinishedRequestStats, StepStats


def _totals(engine: LLMEngine) -> tuple[int, int, int, int, int]:
    return (
        engine.num_prompt_tokens_total,
        engine.num_generation_tokens_total,
        engine.scheduler.num_preemptions_total,
        engine.kv.num_prefix_queries,
        engine.kv.num_prefix_hits,
    )


def _structured_totals(engine: LLMEngine) -> tuple[float, dict[str, int]]:
    return engine.structured.mask_seconds_total, dict(engine.structured.requests_total)


def parent_id(request_id: str) -> str:
    """The API request an engine request belongs to (``<parent>-<index>``); itself if unsuffixed."""
    return request_id.rsplit("-", 1)[0]


@dataclass(slots=True)
class _Parent:
    """The engine requests of one API request seen so far."""

    num_requests: int = 0  # its n, once all are seen (they are, the first time any is)
    num_unfinished: int = 0
    max_tokens: int | None = None  # the same for every one of them: their params are shared


def finished_stats(
    output: RequestOutput, max_tokens: int | None = None, n: int | None = None
) -> FinishedRequestStats:
    """Phase durations of a finished request from its timestamps (0 for phases it never reached),
    with its effective ``max_tokens`` and, on the last request of its API request, that ``n``
    (None: not observed)."""
    times = output.times or RequestTimes(arrival=0.0, finished=0.0)
    end = times.finished if times.finished is not None else times.arrival
    scheduled = times.scheduled if times.scheduled is not None else end
    first = times.first_token if times.first_token is not None else scheduled
    last = times.last_token if times.last_token is not None else first
    completion = output.outputs[0]
    return FinishedRequestStats(
        finished_reason=completion.finish_reason or "abort",
        num_prompt_tokens=len(output.prompt_token_ids),
        num_generation_tokens=len(completion.token_ids),
        e2e_seconds=max(0.0, end - times.arrival),
        queue_seconds=max(0.0, scheduled - times.arrival),
        prefill_seconds=max(0.0, first - scheduled),
        decode_seconds=max(0.0, last - first),
        inference_seconds=max(0.0, last - scheduled),
        max_tokens=max_tokens,
        n=n,
    )


class StatsRecorder:
    def __init__(self, metrics: EngineMetrics, engine: LLMEngine) -> None:
        self.metrics = metrics
        self._last_totals = _totals(engine)
        self._last_structured = _structured_totals(engine)
        self._last_token_time: dict[str, float] = {}
        self._max_tokens: dict[str, int | None] = {}  # unfinished requests seen -> their max_tokens
        self._parents: dict[str, _Parent] = {}

    def reset(self, engine: LLMEngine) -> None:
        """Forget what happened so far (e.g. the warm-up request)."""
        self._last_totals = _totals(engine)
        self._last_structured = _structured_totals(engine)
        self._last_token_time.clear()
        self._max_tokens.clear()
        self._parents.clear()

    def record(self, engine: LLMEngine, outputs: list[RequestOutput], *, ran_step: bool) -> None:
        totals = _totals(engine)
        delta = [now - before for now, before in zip(totals, self._last_totals, strict=True)]
        self._last_totals = totals
        mask_seconds, structured_requests = self._structured_delta(engine)
        self._learn(engine, outputs)
        ttfts, itls = [], []
        for output in outputs:
            times = output.times
            if output.new_token_ids and times is not None and times.last_token is not None:
                previous = self._last_token_time.get(output.request_id)
                if previous is None and times.first_token is not None:
                    ttfts.append(times.first_token - times.arrival)
                elif previous is not None:
                    itls.append(times.last_token - previous)
                self._last_token_time[output.request_id] = times.last_token
            if output.finished:
                self._last_token_time.pop(output.request_id, None)
        self.metrics.record_step(
            StepStats(
                num_running=len(engine.scheduler.running),
                num_waiting=len(engine.scheduler.waiting),
                kv_cache_usage_ratio=engine.block_pool.usage_ratio,
                num_prompt_tokens=delta[0],
                num_generation_tokens=delta[1],
                num_preemptions=delta[2],
                num_prefix_queries=delta[3],
                num_prefix_hits=delta[4],
                ran_step=ran_step,
                time_to_first_tokens_seconds=tuple(ttfts),
                inter_token_latencies_seconds=tuple(itls),
                structured_mask_seconds=mask_seconds,
                num_structured_requests=structured_requests,
            )
        )
        for output in outputs:
            if output.finished:
                self.metrics.record_finished(self._finished(output))

    def _structured_delta(self, engine: LLMEngine) -> tuple[float, dict[str, int]]:
        """What the engine's structured-output counters gained since the previous record."""
        seconds, requests = _structured_totals(engine)
        last_seconds, last_requests = self._last_structured
        self._last_structured = (seconds, requests)
        gained = {kind: count - last_requests.get(kind, 0) for kind, count in requests.items()}
        return seconds - last_seconds, {kind: count for kind, count in gained.items() if count}

    def _learn(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        """Note the requests seen for the first time: their effective max_tokens, their parent."""
        for request in itertools.chain(engine.scheduler.running, engine.scheduler.waiting):
            if request.request_id not in self._max_tokens:
                self._learn_one(request.request_id, request.max_total_tokens - len(request.prompt_token_ids))
        for output in outputs:
            if output.request_id not in self._max_tokens:
                completion = output.outputs[0]
                ran_out = completion.finish_reason == "length"
                self._learn_one(output.request_id, len(completion.token_ids) if ran_out else None)

    def _learn_one(self, request_id: str, max_tokens: int | None) -> None:
        self._max_tokens[request_id] = max_tokens
        parent = self._parents.setdefault(parent_id(request_id), _Parent())
        parent.num_requests += 1
        parent.num_unfinished += 1
        if max_tokens is not None:
            parent.max_tokens = max_tokens

    def _finished(self, output: RequestOutput) -> FinishedRequestStats:
        """The stats of a finished request; the last of its parent's requests also gives n."""
        key = parent_id(output.request_id)
        parent = self._parents[key]
        max_tokens = self._max_tokens.pop(output.request_id)
        parent.num_unfinished -= 1
        n = None
        if parent.num_unfinished == 0:
            n = parent.num_requests
            del self._parents[key]
        return finished_stats(output, max_tokens if max_tokens is not None else parent.max_tokens, n)

"""Turn engine steps into metric observations: counter increments, TTFT/ITL, finished requests.

Runs on the engine thread right after each step (it reads the engine's counters,
``LLMEngine.counters``, which only that thread changes) and feeds
``kunlun_runtime.server.metrics.EngineMetrics``. Counters are the differences of the
engine's running totals since the previous call, so a warm-up run before ``reset`` is not counted.

A finished request also reports its parameters, as vLLM observes them: its effective
``max_tokens`` (as asked, or what the context leaves: ``RequestOutput.max_tokens``), and, once per
prompt, its ``n``. The n engine requests of one prompt are named ``<parent>-<index>``
(``request_building.children``) and the engine thread announces each group it adds (``expect``); the last
of a parent's requests to finish reports their number. With LoRA on, every turn also stamps which
adapters the running and waiting requests use (``vllm:lora_requests_info``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from kunlun_runtime.engine.outputs import EngineCounters, RequestOutput, RequestTimes
from kunlun_runtime.server.lora_metrics import LoRARequestsInfo
from kunlun_runtime.server.metrics import EngineMetrics, FinishedRequestStats, StepStats
from kunlun_runtime.server.spec_metrics import SpecDecodeMetrics


class CountingEngine(Protocol):
    """What the recorder reads: the engine's counters and, with LoRA, which adapters its
    requests use (``LLMEngine``, ``AsyncEngine``)."""

    def counters(self) -> EngineCounters: ...

    def lora_activity(self) -> tuple[int, list[str], list[str]]: ...


def _totals(counters: EngineCounters) -> tuple[int, int, int, int, int, int]:
    return (
        counters.num_prompt_tokens_total,
        counters.num_generation_tokens_total,
        counters.num_preemptions_total,
        counters.num_prefix_queries,
        counters.num_prefix_hits,
        counters.num_kv_event_batches_dropped,
    )


def _structured_totals(counters: EngineCounters) -> tuple[float, dict[str, int]]:
    return counters.structured_mask_seconds_total, dict(counters.structured_requests_total)


def parent_id(request_id: str) -> str:
    """The API request an engine request belongs to (``<parent>-<index>``); itself if unsuffixed."""
    return request_id.rsplit("-", 1)[0]


@dataclass(slots=True)
class _Parent:
    """The engine requests of one prompt (its n choices)."""

    num_requests: int = 0
    num_unfinished: int = 0


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
    def __init__(
        self,
        metrics: EngineMetrics,
        engine: CountingEngine,
        lora_info: LoRARequestsInfo | None = None,
        spec_metrics: SpecDecodeMetrics | None = None,
    ) -> None:
        self.metrics = metrics
        self.lora_info = lora_info  # None: LoRA is off, and vLLM shows no such gauge then
        self.spec_metrics = spec_metrics  # None: speculative decoding is off
        counters = engine.counters()
        self._last_totals = _totals(counters)
        self._last_structured = _structured_totals(counters)
        self._last_token_time: dict[str, float] = {}
        self._parents: dict[str, _Parent] = {}

    def reset(self, engine: CountingEngine) -> None:
        """Forget what happened so far (e.g. the warm-up request)."""
        counters = engine.counters()
        self._last_totals = _totals(counters)
        self._last_structured = _structured_totals(counters)
        self._last_token_time.clear()
        self._parents.clear()

    def record(self, engine: CountingEngine, outputs: list[RequestOutput], *, ran_step: bool) -> None:
        counters = engine.counters()
        totals = _totals(counters)
        delta = [now - before for now, before in zip(totals, self._last_totals, strict=True)]
        self._last_totals = totals
        mask_seconds, structured_requests = self._structured_delta(counters)
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
                num_running=counters.num_running,
                num_waiting=counters.num_waiting,
                kv_cache_usage_ratio=counters.kv_cache_usage_ratio,
                num_prompt_tokens=delta[0],
                num_generation_tokens=delta[1],
                num_preemptions=delta[2],
                num_prefix_queries=delta[3],
                num_prefix_hits=delta[4],
                num_kv_event_batches_dropped=delta[5],
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
        if self.lora_info is not None:
            self.lora_info.update(*engine.lora_activity())
        if self.spec_metrics is not None and counters.spec_decode is not None:
            self.spec_metrics.update(counters.spec_decode)

    def _structured_delta(self, counters: EngineCounters) -> tuple[float, dict[str, int]]:
        """What the engine's structured-output counters gained since the previous record."""
        seconds, requests = _structured_totals(counters)
        last_seconds, last_requests = self._last_structured
        self._last_structured = (seconds, requests)
        gained = {kind: count - last_requests.get(kind, 0) for kind, count in requests.items()}
        return seconds - last_seconds, {kind: count for kind, count in gained.items() if count}

    def expect(self, request_ids: Iterable[str]) -> None:
        """Note engine requests just added (a group of one API request), to report each prompt's
        n when its last request finishes. Requests never announced report no n."""
        for request_id in request_ids:
            parent = self._parents.setdefault(parent_id(request_id), _Parent())
            parent.num_requests += 1
            parent.num_unfinished += 1

    def _finished(self, output: RequestOutput) -> FinishedRequestStats:
        """The stats of a finished request; the last of its parent's requests also gives n."""
        key = parent_id(output.request_id)
        parent = self._parents.get(key)
        n = None
        if parent is not None:
            parent.num_unfinished -= 1
            if parent.num_unfinished == 0:
                n = parent.num_requests
                del self._parents[key]
        return finished_stats(output, output.max_tokens, n)

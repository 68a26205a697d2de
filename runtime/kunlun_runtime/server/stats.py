"""Turn engine steps into metric observations: counter increments, TTFT/ITL, finished requests.

Runs on the engine thread right after each step (it reads engine counters, which only that thread
changes) and feeds ``kunlun_runtime.metrics.EngineMetrics``. Counters are the differences of the
engine's running totals since the previous call, so a warm-up run before ``reset`` is not counted.
"""

from __future__ import annotations

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


def finished_stats(output: RequestOutput) -> FinishedRequestStats:
    """Phase durations of a finished request from its timestamps (0 for phases it never reached)."""
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
    )


class StatsRecorder:
    def __init__(self, metrics: EngineMetrics, engine: LLMEngine) -> None:
        self.metrics = metrics
        self._last_totals = _totals(engine)
        self._last_token_time: dict[str, float] = {}

    def reset(self, engine: LLMEngine) -> None:
        """Forget what happened so far (e.g. the warm-up request)."""
        self._last_totals = _totals(engine)
        self._last_token_time.clear()

    def record(self, engine: LLMEngine, outputs: list[RequestOutput], *, ran_step: bool) -> None:
        totals = _totals(engine)
        delta = [now - before for now, before in zip(totals, self._last_totals, strict=True)]
        self._last_totals = totals
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
            )
        )
        for output in outputs:
            if output.finished:
                self.metrics.record_finished(finished_stats(output))

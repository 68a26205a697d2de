"""What the engine hands back: per-request outputs, shaped like vLLM's RequestOutput, and the
engine's running totals for metrics (``EngineCounters``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kunlun_runtime.engine.logprobs import TokenLogprob


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestTimes:
    """Wall-clock timestamps (time.monotonic) of a request's milestones."""

    arrival: float
    scheduled: float | None = None  # first admitted to a step
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0
    times: RequestTimes | None = None
    new_token_ids: list[int] = field(default_factory=list)  # generated in the step that produced this
    max_tokens: int | None = None  # the effective output budget: as asked, or what the context left


@dataclass(frozen=True, slots=True)
class EngineCounters:
    """The engine's queue sizes and running totals after its last step (``LLMEngine.counters``):
    the totals only grow, so a reader takes differences between two snapshots."""

    num_running: int  # requests in the running batch
    num_waiting: int  # requests waiting to be admitted (preempted ones included)
    kv_cache_usage_ratio: float  # the share of KV blocks in use, 0..1
    num_prompt_tokens_total: int  # prompt tokens of the requests that produced a first token
    num_generation_tokens_total: int  # tokens generated
    num_preemptions_total: int  # requests preempted (their KV blocks taken back)
    num_prefix_queries: int  # prompt tokens looked up in the prefix cache
    num_prefix_hits: int  # of those, the tokens found there
    structured_mask_seconds_total: float  # time spent computing allowed-token masks
    structured_requests_total: tuple[tuple[str, int], ...]  # (constraint kind, requests) per kind
    # KV event batches dropped because the publisher's queue was full (--kv-events-config's
    # max_queue_size): each a gap in the sequence numbers subscribers see; 0 with events off
    num_kv_event_batches_dropped: int = 0
    # Speculative decoding's totals (drafts, draft tokens, accepted tokens, accepted per position);
    # None with it off
    spec_decode: tuple[int, int, int, tuple[int, ...]] | None = None

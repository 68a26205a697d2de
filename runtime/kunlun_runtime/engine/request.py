"""A request's lifecycle state inside the engine (owned by the scheduler and the engine loop)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kunlun_runtime.engine.logprobs import TokenLogprob
from kunlun_runtime.engine.sampling_params import SamplingParams
from kunlun_runtime.lora.request import LoRARequest


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"


FINISHED = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
)


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_total_tokens: int  # prompt + output may not exceed this (max_model_len or max_tokens)
    arrival_order: int = 0  # the scheduler's count of requests added before it: ties keep arrival order
    arrival_time: float = 0.0
    priority: int = 0  # lower value = served earlier (vLLM convention)
    cache_salt: str | None = None  # isolates this tenant's prefix-cache entries
    lora: LoRARequest | None = None  # the adapter it runs on (None: the base model)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    num_preemptions: int = 0
    waited_steps: int = 0
    protected: bool = False  # preempted max_preemptions times: never preempted again
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    # Drafts to verify in the next step (speculative decoding), after its last token; not tokens
    # of the request until accepted.
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def lora_key(self) -> tuple[int, str] | None:
        """The adapter's (id, name), part of the prefix-cache key; None on the base model."""
        return None if self.lora is None else (self.lora.lora_int_id, self.lora.lora_name)

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

"""Drive one batch of requests through an engine to the end and time its decode (shared by the
side-by-side benchmarks that run the engine in-process)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class BatchTiming:
    decode_tokens: int  # output tokens after each request's first
    decode_seconds: float  # from the batch's last first token to its end
    first_token_seconds: tuple[float, ...]  # each request's time to its first token

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_seconds


def run_batch(
    engine: Any,
    prompts: Sequence[list[int]],
    params: Any,
    loras: Sequence[Any] | None = None,
    cache_salt: str | None = None,
) -> BatchTiming:
    """Add every prompt (token ids; with its LoRA request where given; all under ``cache_salt``,
    one tenant) at once, step until all finish, and time it."""
    began = time.perf_counter()
    for index, prompt in enumerate(prompts):
        lora = None if loras is None else loras[index]
        engine.add_request(
            f"bench-{began}-{index}",
            {"prompt_token_ids": prompt},
            params,
            lora_request=lora,
            cache_salt=cache_salt,
        )
    first: dict[str, float] = {}
    counts: dict[str, int] = {}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            first.setdefault(out.request_id, now)
            counts[out.request_id] = len(out.outputs[0].token_ids)
    ended = time.perf_counter()
    return BatchTiming(
        decode_tokens=sum(count - 1 for count in counts.values()),
        decode_seconds=ended - max(first.values()),
        first_token_seconds=tuple(t - began for t in first.values()),
    )

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
    # each request's time from its first token to its last (its own decode, however long the
    # batch's slowest request decodes after it)
    request_decode_seconds: tuple[float, ...] = ()
    # the requests' decode steps, summed: the steps in which a request emitted tokens after its
    # first (one token each without speculation; with it, one plus the drafts it accepted)
    request_decode_steps: int = 0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_seconds

    @property
    def request_decode_tok_s(self) -> float:
        """What a request of the batch decodes at, as its client sees it: tokens after the first
        over the requests' own decode times (1 / the mean time per output token, TPOT, weighted
        by tokens)."""
        return self.decode_tokens / sum(self.request_decode_seconds)


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
    last: dict[str, float] = {}
    counts: dict[str, int] = {}
    steps = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        decoded = set()  # a step's accepted drafts come as outputs of their own, a token each
        for out in outputs:
            count = len(out.outputs[0].token_ids)
            if out.request_id in counts and count > counts[out.request_id]:
                decoded.add(out.request_id)
            first.setdefault(out.request_id, now)
            last[out.request_id] = now
            counts[out.request_id] = count
        steps += len(decoded)
    ended = time.perf_counter()
    return BatchTiming(
        decode_tokens=sum(count - 1 for count in counts.values()),
        decode_seconds=ended - max(first.values()),
        first_token_seconds=tuple(t - began for t in first.values()),
        request_decode_seconds=tuple(last[request_id] - first[request_id] for request_id in first),
        request_decode_steps=steps,
    )


@dataclass(frozen=True, slots=True)
class InFlightTiming:
    decode_tokens: int  # tokens emitted in the steps where every request in flight decoded
    decode_seconds: float  # those steps' time
    decode_steps: int
    requests: int

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


def run_in_flight(
    engine: Any, prompts: Sequence[list[int]], params: Any, in_flight: int, cache_salt: str | None = None
) -> InFlightTiming:
    """Keep ``in_flight`` of ``prompts`` (token ids; all under ``cache_salt``, one tenant) in the
    engine, adding the next as soon as one finishes (a server's continuous batching under that
    many concurrent clients), until all finish; time only the steps in which all ``in_flight``
    requests decode (no prompt waiting or part-prefilled): decode at that batch, whatever the
    requests' lengths, without the prefill of those that arrive or the tail after the last."""
    if len(prompts) < in_flight:
        raise ValueError(
            f"{in_flight} requests in flight need at least {in_flight} prompts, got {len(prompts)}"
        )
    began = time.perf_counter()
    pending = list(enumerate(prompts))
    counts: dict[str, int] = {}
    active = tokens = steps = 0
    seconds = 0.0
    while pending or engine.has_unfinished_requests():
        while pending and active < in_flight:
            index, prompt = pending.pop(0)
            engine.add_request(
                f"bench-{began}-{index}", {"prompt_token_ids": prompt}, params, cache_salt=cache_salt
            )
            active += 1
        # The scheduler's own view (a running request may still be part-way through its prompt):
        # the step decodes the whole batch when every request in flight has one token to compute.
        running = engine.scheduler.running
        full = (
            not engine.scheduler.waiting
            and len(running) == in_flight
            and all(r.num_tokens - r.num_computed_tokens == 1 for r in running)
        )
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        emitted = 0
        for out in outputs:
            count = len(out.outputs[0].token_ids)
            emitted += count - counts.get(out.request_id, 0)
            counts[out.request_id] = count
            active -= out.finished
        if full:
            tokens, seconds, steps = tokens + emitted, seconds + elapsed, steps + 1
    return InFlightTiming(tokens, seconds, steps, len(prompts))

"""Token selection: penalties, temperature, top-k, top-p, min-p, seeded sampling, logprobs.

Each request samples from its own ``torch.Generator`` (seeded by its ``seed`` when given), so its
tokens do not depend on which other requests share the batch. A structured-output request's row is first
masked to the tokens its grammar allows; its grammar, not ``min_tokens``, decides when its text may
end. Logprobs are those of the model's distribution before penalties, temperature and truncation,
after that mask, as vLLM reports them (its model runner masks the logits before its sampler
sees them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kunlun_runtime.engine.logprobs import TokenLogprob
from kunlun_runtime.engine.request import Request
from kunlun_runtime.engine.sampling_params import SamplingParams
from kunlun_runtime.structured.bitmask import apply_token_bitmask


@dataclass(frozen=True, slots=True)
class AllowedTokens:
    """The allowed next tokens of the constrained rows of a step: ``bitmask`` row ``i`` holds
    those of logits row ``rows[i]`` (see ``structured.bitmask``)."""

    rows: tuple[int, ...]
    bitmask: np.ndarray


def apply_penalties(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Repetition (HF style, over prompt and output), presence and frequency (OpenAI style, over
    the output) penalties, in place, row by row for the rows that ask for them."""
    for row, request in enumerate(requests):
        params = request.params
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(request.all_token_ids)), dtype=torch.long, device=logits.device)
            values = logits[row, seen]
            logits[row, seen] = torch.where(
                values > 0, values / params.repetition_penalty, values * params.repetition_penalty
            )
        if (params.presence_penalty or params.frequency_penalty) and request.output_token_ids:
            counts = torch.bincount(
                torch.tensor(request.output_token_ids, device=logits.device), minlength=logits.shape[1]
            ).to(logits.dtype)
            logits[row] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(
                logits.dtype
            )
    return logits


def suppress_stop_tokens(
    logits: torch.Tensor, requests: Sequence[Request], eos_token_ids: Sequence[int]
) -> None:
    """While a request has fewer than ``min_tokens`` outputs, it may not emit EOS or a stop token
    (unless its output is constrained: there the grammar says when the text is complete)."""
    for row, request in enumerate(requests):
        params = request.params
        if len(request.output_token_ids) < params.min_tokens and params.structured_outputs is None:
            banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))
            if banned:
                logits[row, banned] = float("-inf")


def plain_greedy(request: Request) -> bool:
    """Whether ``request``'s choice at every position is the argmax of its raw logits (greedy, no
    penalties, no min_tokens to hold, no logprobs to report): its rows need nothing but one
    batched argmax with the others' (and its drafts verify there)."""
    params = request.params
    return (
        params.greedy
        and params.logprobs is None
        and params.repetition_penalty == 1.0
        and not params.presence_penalty
        and not params.frequency_penalty
        and len(request.output_token_ids) >= params.min_tokens
    )


def truncate_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p on one row of logits; returns probabilities."""
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        drop_sorted = cumulative - sorted_probs > params.top_p  # keep the smallest set reaching top_p
        probs = probs.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), 0.0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def make_logprob(logprobs_row: torch.Tensor, token_id: int, num_top: int) -> TokenLogprob:
    chosen = float(logprobs_row[token_id])
    rank = int((logprobs_row > chosen).sum()) + 1
    top: tuple[tuple[int, float], ...] = ()
    if num_top:
        values, ids = torch.topk(logprobs_row, num_top)
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token_id=token_id, logprob=chosen, rank=rank, top=top)


class Sampler:
    def __init__(
        self,
        eos_token_ids: Sequence[int],
        seed: int = 0,
        argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """``argmax``: row-wise argmax of FP32 [S, V] logits with ``torch.argmax``'s results
        (the platform's faster one, e.g. ``cpu_kernels.argmax_rows``); default ``torch.argmax``."""
        self.eos_token_ids = list(eos_token_ids)
        self.argmax = argmax or (lambda logits: torch.argmax(logits, dim=-1))
        self._seed_source = torch.Generator().manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def generator(self, request: Request) -> torch.Generator:
        """The request's own generator (seeded by its ``seed`` when given)."""
        generator = self._generators.get(request.request_id)
        if generator is None:
            seed = request.params.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_source))
            generator = torch.Generator().manual_seed(seed)
            self._generators[request.request_id] = generator
        return generator

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def sample(
        self, logits: torch.Tensor, requests: Sequence[Request], allowed: AllowedTokens | None = None
    ) -> list[tuple[int, TokenLogprob | None]]:
        """Pick one token per row of FP32 ``logits`` [S, V] among the ``allowed`` ones of the
        constrained rows; returns (token id, logprob or None)."""
        if allowed is None and all(plain_greedy(request) for request in requests):
            # Nothing to change in the logits: no copy of them (a step of 8 rows of a 49k
            # vocabulary copies 1.5 MB) and no passes over the rows that would change nothing.
            return [(token_id, None) for token_id in self.argmax(logits).tolist()]
        logits = logits.clone()
        if allowed is not None:
            self.mask(logits, allowed)
        raw_logprobs = None
        if any(r.params.logprobs is not None for r in requests):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = apply_penalties(logits, requests)
        suppress_stop_tokens(logits, requests, self.eos_token_ids)
        greedy_ids = self.argmax(logits).tolist()
        results = []
        for row, request in enumerate(requests):
            params = request.params
            if params.greedy:
                token_id = greedy_ids[row]
            else:
                probs = truncate_distribution(logits[row], params)
                token_id = int(torch.multinomial(probs.cpu(), 1, generator=self.generator(request)))
            logprob = None
            if params.logprobs is not None:
                assert raw_logprobs is not None  # computed above for any row that wants logprobs
                logprob = make_logprob(raw_logprobs[row], token_id, params.logprobs)
            results.append((token_id, logprob))
        return results

    def mask(self, logits: torch.Tensor, allowed: AllowedTokens) -> None:
        """Mask the constrained rows of ``logits``, in place. A row left with no token (a grammar in
        an error state) gets EOS, so the request ends instead of the sampler failing."""
        apply_token_bitmask(logits, allowed.bitmask, allowed.rows)
        if self.eos_token_ids:  # without a host sync: a dead row's EOS logit becomes 0, others stay
            rows = torch.tensor(allowed.rows, dtype=torch.long, device=logits.device)
            dead = torch.isneginf(logits.index_select(0, rows)).all(dim=-1)
            eos = self.eos_token_ids[0]
            logits[rows, eos] = torch.where(
                dead, torch.zeros_like(dead, dtype=logits.dtype), logits[rows, eos]
            )

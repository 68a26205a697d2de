"""Speculative decoding's verifying side: the tokens a request emits from the logits of its
last token and its drafts, exactly as decoding without drafts would emit them (greedy), or
distributed exactly so (sampling, by speculative sampling's rejection rule). Must not: propose
drafts or know the engine.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kunlun_runtime.engine.logprobs import TokenLogprob
from kunlun_runtime.engine.request import Request
from kunlun_runtime.engine.sampler import (
    apply_penalties,
    make_logprob,
    suppress_stop_tokens,
    truncate_distribution,
)


def accept_greedy(choices: Sequence[int], drafts: Sequence[int]) -> tuple[list[int], int]:
    """The tokens a plain greedy request emits given the model's choice at each position (after
    its last token and after each draft): the drafts it agrees with, then its own choice."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == choices[accepted]:
        accepted += 1
    return [*drafts[:accepted], choices[accepted]], accepted


def verify(
    logits: torch.Tensor,
    request: Request,
    drafts: Sequence[int],
    eos_token_ids: Sequence[int],
    generator: torch.Generator,
) -> tuple[list[tuple[int, TokenLogprob | None]], int]:
    """The tokens ``request`` emits from FP32 ``logits`` [len(drafts) + 1, V] (row i: the
    distribution after the i-th draft) and how many drafts it accepted. The request's own output
    is extended position by position while deciding (penalties and min_tokens see the accepted
    drafts) and restored before returning."""
    params = request.params
    outputs = request.output_token_ids
    original_length = len(outputs)
    emitted: list[tuple[int, TokenLogprob | None]] = []
    accepted = 0
    try:
        for position in range(len(drafts) + 1):
            row = logits[position : position + 1].clone()
            raw = torch.log_softmax(row[0], dim=-1) if params.logprobs is not None else None
            apply_penalties(row, [request])
            suppress_stop_tokens(row, [request], eos_token_ids)
            draft = drafts[position] if position < len(drafts) else None
            if params.greedy:
                token = int(torch.argmax(row[0]))
                take_draft = draft is not None and token == draft
            else:
                probs = truncate_distribution(row[0], params)
                take_draft = draft is not None and float(torch.rand((), generator=generator)) < float(
                    probs[draft]
                )
                if take_draft and draft is not None:
                    token = draft
                else:
                    if draft is not None:  # the residual: p without the rejected draft
                        probs = probs.clone()
                        probs[draft] = 0.0
                        probs = probs / probs.sum()
                    token = int(torch.multinomial(probs.cpu(), 1, generator=generator))
            emitted.append((token, None if raw is None else make_logprob(raw, token, params.logprobs or 0)))
            outputs.append(token)
            if not take_draft:
                break
            accepted += 1
    finally:
        del outputs[original_length:]
    return emitted, accepted

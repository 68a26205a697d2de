"""Logprobs in vLLM's offline shape: per position, a dict ``token_id -> Logprob``.

The engine records each position as a ``TokenLogprob`` (defined here, so that the server and
``LLM`` read it from the engine's public surface: the chosen token's logprob and rank, and the
top-N alternatives); the server turns that into OpenAI's JSON, and ``LLM`` turns it into this
shape, the one code written for vLLM's offline API reads: ``out.logprobs[i][token_id].logprob``,
``.rank`` and ``.decoded_token``. The meaning follows vLLM v1:

- a position's dict holds the chosen token (the sampled one, or the prompt's own token) with its
  rank in the whole vocabulary, and the top-N tokens with ranks 1..N; a chosen token among the
  top-N appears once, with its top-N entry, so a dict has N + 1 entries, or N;
- the chosen token is the dict's first key (its insertion order), the top-N follow by rank;
- ``decoded_token`` is the token decoded on its own, special tokens kept;
- prompt logprobs start with ``None``: the first prompt token has nothing before it.

This module imports nothing of ours, so any layer may use ``Logprob`` and ``TokenLogprob``. It
never decodes by itself: the caller passes ``decode``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Logprob:
    """One token's entry at one position (vLLM's ``vllm.logprobs.Logprob``, same fields)."""

    logprob: float  # natural log of the token's probability under the model's raw distribution
    rank: int | None = None  # 1 = the most likely token in the vocabulary
    decoded_token: str | None = None  # the token decoded on its own


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Logprob of one chosen token and the top alternatives at that position (the engine's record)."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: tuple[tuple[int, float], ...]  # (token_id, logprob), most likely first


PositionLogprobs = dict[int, Logprob]
SampleLogprobs = list[PositionLogprobs]  # one dict per generated token
PromptLogprobs = list[PositionLogprobs | None]  # None first, then one dict per prompt token


def build_position_logprobs(item: TokenLogprob, decode: Callable[[int], str]) -> PositionLogprobs:
    """The dict of one position: the chosen token first, then the top-N by rank.

    Args:
        item: the engine's record of the position.
        decode: one token id to its text (decoded on its own, special tokens kept).

    Returns:
        ``token_id -> Logprob`` with N + 1 entries, or N when the chosen token is among the top-N
        (then its top-N rank stands, as in vLLM).
    """
    position = {item.token_id: Logprob(item.logprob, item.rank, decode(item.token_id))}
    for rank, (token_id, logprob) in enumerate(item.top, start=1):
        position[token_id] = Logprob(logprob, rank, decode(token_id))
    return position


def build_sample_logprobs(items: Sequence[TokenLogprob], decode: Callable[[int], str]) -> SampleLogprobs:
    """One dict per generated token, in order (see ``build_position_logprobs``)."""
    return [build_position_logprobs(item, decode) for item in items]


def build_prompt_logprobs(
    items: Sequence[TokenLogprob | None], decode: Callable[[int], str]
) -> PromptLogprobs:
    """One entry per prompt token: ``None`` where the engine has none (the first token), else its
    dict (see ``build_position_logprobs``)."""
    return [None if item is None else build_position_logprobs(item, decode) for item in items]

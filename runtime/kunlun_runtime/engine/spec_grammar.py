"""Speculative decoding under a structured-output grammar: drafts the grammar accepts, verified
over the grammar's distribution at every position.

Owns two decisions. Before a step, a constrained request's drafts are cut at the first token its
grammar would refuse from its current state (``GrammarMatcher.validate``, which leaves the state
as it was), so no row is computed for a token that could never be emitted. After the forward, each
of its rows is masked by the grammar's state at that position: the row after its last token by the
state now, the row after draft ``i`` by the state after drafts ``0..i`` (``GrammarMasks`` computes
them during the forward, advancing each matcher through its drafts and rolling it back).
Verification then runs unchanged over the masked rows: greedy accepts while the masked argmax is
the draft, sampling applies its rejection rule to the masked distribution, so the tokens are
those of decoding the constrained request one token at a time.

Must not advance a grammar: the engine does, token by token as it emits them, so a matcher only
ever holds the tokens its request emitted, and a rejected draft never leaves it advanced.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kunlun_runtime.engine.sampler import AllowedTokens, Sampler
from kunlun_runtime.structured.grammar import GrammarMatcher


def grammar_drafts(grammar: GrammarMatcher | None, drafts: Sequence[int]) -> list[int]:
    """``drafts`` up to (not including) the first token ``grammar`` refuses from its current
    state, which is left unchanged; all of them for a request without a grammar."""
    if grammar is None or not drafts:
        return list(drafts)
    return list(drafts[: grammar.validate(drafts)])


def masked_logits(sampler: Sampler, logits: torch.Tensor, allowed: AllowedTokens | None) -> torch.Tensor:
    """``logits`` [rows, V] with every constrained row masked to its position's allowed tokens
    (``allowed.rows`` index the rows of ``logits``: a request's last token's, then its drafts'); a
    copy when there is a mask, ``logits`` itself otherwise."""
    if allowed is None:
        return logits
    masked = logits.clone()
    sampler.mask(masked, allowed)
    return masked

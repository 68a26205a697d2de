"""The structured-output side of a step: the allowed-token masks of the constrained requests that
sample, and each chosen token advancing its request's grammar.

Owns: which rows of a step are constrained, computing their masks (on a worker thread during the
forward, or in line), and what a grammar's verdict on a token means for its request. Must not
sample or schedule: the engine hands the masks to the sampler. The grammar engine releases the GIL,
so the masks cost the step nothing while the forward runs; on the CPU platform, whose forward keeps
every core busy, it measured no slower than in line and faster at batch 8 (docs/performance.md).
Between ``start`` and ``result`` the matchers are the worker thread's: a request with drafts has
its matcher advanced through them and rolled back there.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kunlun_runtime.engine.request import RequestStatus
from kunlun_runtime.engine.sampler import AllowedTokens
from kunlun_runtime.engine.scheduler_output import SchedulerOutput
from kunlun_runtime.structured.grammar import GrammarCompiler, GrammarMatcher

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PendingMasks:
    """The allowed-token masks of a step's constrained rows, being computed during the forward."""

    rows: tuple[int, ...]
    bitmask: concurrent.futures.Future[np.ndarray]

    def result(self) -> AllowedTokens:
        """The masks, once computed (waits for the worker thread if it is still at it)."""
        return AllowedTokens(self.rows, self.bitmask.result())


class GrammarMasks:
    """Starts each step's masks; owns the worker thread they are computed on."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # started on first use

    def start(
        self,
        sched: SchedulerOutput,
        grammar_of: Callable[[str], GrammarMatcher | None],
        *,
        overlap: bool = True,
    ) -> PendingMasks | None:
        """Start computing the allowed tokens of the constrained requests that sample this step, in
        the rows the runner gives them (those whose scheduled tokens reach their end: one for the
        last token, then one per draft, each masked by the grammar's state after the drafts before
        it); None when no such request samples. ``overlap`` False computes them now, in line (for
        comparison)."""
        rows: list[int] = []
        matchers: list[GrammarMatcher] = []
        drafts: list[list[int]] = []
        row = 0
        for item in sched.scheduled:
            request = item.request
            if (
                request.num_computed_tokens + item.num_new_tokens - item.num_draft_tokens
                != request.num_tokens
            ):
                continue
            grammar = grammar_of(request.request_id)
            if grammar is not None:
                rows.extend(range(row, row + 1 + item.num_draft_tokens))
                matchers.append(grammar)
                drafts.append(request.spec_token_ids[: item.num_draft_tokens])
            row += 1 + item.num_draft_tokens
        if not matchers:
            return None
        if not overlap:
            done: concurrent.futures.Future[np.ndarray] = concurrent.futures.Future()
            done.set_result(self.compiler.fill_bitmask(matchers, drafts))
            return PendingMasks(tuple(rows), done)
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        return PendingMasks(tuple(rows), self._pool.submit(self.compiler.fill_bitmask, matchers, drafts))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def advance_grammar(grammar: GrammarMatcher, token_id: int) -> RequestStatus | None:
    """Advance ``grammar`` by the chosen token: ``stop`` when the constrained text is complete, None
    while it goes on. A grammar that refuses the token (its mask never offers one it refuses, so it
    is in an error state: an engine limit reached) is logged and ends the request as aborted, not
    as a valid ``stop``."""
    if not grammar.accept(token_id):
        logger.error("structured output: the grammar refused token %d (%s)", token_id, grammar.error)
        return RequestStatus.FINISHED_ABORTED
    return RequestStatus.FINISHED_STOPPED if grammar.is_finished else None

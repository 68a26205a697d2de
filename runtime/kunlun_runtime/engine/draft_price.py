"""What a speculative draft row adds to a decode step, measured on adjacent steps of the same requests.

The engine's step-time model (``step_cost``) fits every step in a window by least squares. Its
draft terms rest on the few steps that drafted, beside many that did not, of other batch sizes
and contexts (batch 1 before batch 8, prompts being prefilled): on copy tasks at batch 8 it
priced a draft row well above what it adds and the plain step well below its time, refused
drafts that paid, and, drafting rarely, never learnt otherwise (docs/performance.md). Two adjacent pure decode steps
of the same requests differ only by their drafts (the context grows by a token or a few, the
machine's state is the same), so their difference prices the drafts without any model:

    price ≈ median over recent pairs of (seconds with d drafts - seconds without) / d

and the plain step's own time is the recent mean of the steps without drafts of those requests.
Pairs are kept per number of decoding requests (a draft row beside one decode row rides on a
read of the weights that is memory-bound; beside eight, the linears are compute-bound and it
costs several times more). A step's rows stay within one pass of the kernels over the weights
(the engine caps them), so a row's price does not depend on how many drafts there are. Pure
Python: no torch, no clock.
"""

from __future__ import annotations

import statistics
from collections import deque

# Recent pairs whose median is the price: one slow step (another tenant, a page fault) is outvoted.
SAMPLES = 8
PLAIN_MEMORY = 0.5  # per step without drafts: the weight of the past in the plain step's mean


class DraftRowPrice:
    """The seconds a draft row adds to a pure decode step, and those of the step without drafts
    of the latest set of decoding requests (``batch``: their ids)."""

    def __init__(self) -> None:
        self._batch: frozenset[str] | None = None
        self._plain: float | None = None  # mean seconds of this batch's steps without drafts
        self._samples: dict[int, deque[float]] = {}  # by the number of decoding requests

    def observe(self, batch: frozenset[str], draft_rows: int, seconds: float) -> None:
        """A pure decode step of ``batch``'s requests with ``draft_rows`` drafts took ``seconds``."""
        if not 0.0 <= seconds < float("inf") or draft_rows < 0:
            return
        if batch != self._batch:
            self._batch, self._plain = batch, None
        if draft_rows == 0:
            self._plain = (
                seconds if self._plain is None else PLAIN_MEMORY * self._plain + (1 - PLAIN_MEMORY) * seconds
            )
        elif self._plain is not None:
            samples = self._samples.setdefault(len(batch), deque(maxlen=SAMPLES))
            samples.append(max(0.0, (seconds - self._plain) / draft_rows))

    def series(self, batch: frozenset[str], count: int) -> list[float] | None:
        """Predicted seconds of ``batch``'s next step with 0 … ``count`` drafts; None until a step
        without drafts of these requests has been seen. Drafts beside as many requests as never
        paired are priced 0, so they run and are priced from then on (the step-time model,
        which would be asked instead, prices them by the steps that mislead it)."""
        if batch != self._batch or self._plain is None:
            return None
        samples = self._samples.get(len(batch))
        price = statistics.median(samples) if samples else 0.0
        return [self._plain + i * price for i in range(count + 1)]

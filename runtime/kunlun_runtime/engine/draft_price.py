"""What a speculative draft row adds to a decode step, measured on adjacent steps of the same requests.

The engine's step-time model (``step_cost``) fits every step in a window by least squares. Its
draft terms rest on the few steps that drafted, beside many that did not, of other batch sizes
and contexts (batch 1 before batch 8, prompts being prefilled): on copy tasks at batch 8 it
priced a draft row well above what it adds and the plain step well below its time, refused
drafts that paid, and, drafting rarely, never learnt otherwise (docs/performance.md). Two adjacent pure decode steps
of the same requests differ only by their drafts (the context grows by a token or a few, the
machine's state is the same), so their difference prices the drafts without any model:

    price ≈ median over recent pairs of (seconds with d drafts - seconds without) / d,
            each pair counting d times

and the plain step's own time is the recent mean of the steps without drafts of those requests.
A batch that drafts in every step (long copies, many drafts each) never shows its plain step: its
adjacent steps with different numbers of drafts price a row instead, and its latest step less its
drafts is its plain step. A batch that drafts the same number of rows step after step, unpriced,
shows neither: ``wants_probe`` then asks for a step with fewer drafts (the engine drops the less
likely half: the step down and the step back up are two pairs of that many rows).
A pair's error is the step's noise over its drafts (a batch-8 step of ~30 ms varies by a few ms
on a shared machine, so one pair of one draft can put a row at 5 ms): a pair counts as many times
as it has drafts, and the price holds only once its pairs have measured ``MIN_ROWS`` rows; before
that the rows count as unpriced (they run, and are measured). With requests coming and going
(every few steps at batch 8 under continuous batching) a batch's own pairs are few, and one
noisy pair priced rows at 5.7 ms (where ~2 ms was measured over many), refused every draft after
it, and so was never outvoted.
A price also expires: pairs older than ``PRICE_STEPS`` pure decode steps beside as many requests
no longer count. While drafts run, new pairs replace old ones long before that; but a price set
high by a busy spell (another tenant, a page-fault storm) refuses every draft and so never sees
another pair (the likeliest reading of a benchmark run whose copy cells stopped drafting after a
noisy spell while a fresh process drafted them as usual).
Once its pairs expire the drafts run unpriced for a step or two and are priced afresh: where
drafts do not pay, one or two steps with drafts in every ``PRICE_STEPS``.
Pairs are kept per number of decoding requests (a draft row beside one decode row rides on a
read of the weights that is memory-bound; beside eight, the linears are compute-bound and it
costs several times more). A step's rows stay within one pass of the kernels over the weights
(the engine caps them), so a row's price does not depend on how many drafts there are. Pure
Python: no torch, no clock.
"""

from __future__ import annotations

from collections import deque

# Recent pairs whose median is the price: one slow step (another tenant, a page fault) is outvoted.
SAMPLES = 8
MIN_ROWS = 8  # draft rows the pairs must have measured before their price holds
PLAIN_MEMORY = 0.5  # per step without drafts: the weight of the past in the plain step's mean
STEADY_STEPS = 3  # steps of one unpriced batch with the same draft rows before a probe
PRICE_STEPS = 256  # pure decode steps beside as many requests a pair counts for


class DraftRowPrice:
    """The seconds a draft row adds to a pure decode step, and those of the step without drafts
    of the latest set of decoding requests (``batch``: their ids)."""

    def __init__(self) -> None:
        self._batch: frozenset[str] | None = None
        self._plain: float | None = None  # mean seconds of this batch's steps without drafts
        # (price of a row, draft rows, step) of recent pairs, by the number of decoding requests
        self._samples: dict[int, deque[tuple[float, int, int]]] = {}
        self._steps: dict[int, int] = {}  # pure decode steps seen, by the number of decoding requests
        self._last: tuple[int, float] | None = None  # this batch's latest step: (draft rows, seconds)
        self._steady = 0  # this batch's steps just before its latest that ran as many draft rows

    def observe(self, batch: frozenset[str], draft_rows: int, seconds: float) -> None:
        """A pure decode step of ``batch``'s requests with ``draft_rows`` drafts took ``seconds``."""
        if not 0.0 <= seconds < float("inf") or draft_rows < 0:
            return
        if batch != self._batch:
            self._batch, self._plain, self._last, self._steady = batch, None, None, 0
        self._steps[len(batch)] = self._steps.get(len(batch), 0) + 1
        last = self._last
        if draft_rows == 0:
            self._plain = (
                seconds if self._plain is None else PLAIN_MEMORY * self._plain + (1 - PLAIN_MEMORY) * seconds
            )
        elif self._plain is not None:
            self._sample(len(batch), seconds - self._plain, draft_rows)
        elif last is not None and last[0] not in (0, draft_rows):
            self._sample(len(batch), seconds - last[1], draft_rows - last[0])
        self._steady = self._steady + 1 if last is not None and last[0] == draft_rows else 0
        self._last = (draft_rows, seconds)

    def _sample(self, requests: int, seconds: float, rows: int) -> None:
        """``rows`` more drafts took ``seconds`` more (fewer: both negative)."""
        self._samples.setdefault(requests, deque(maxlen=SAMPLES)).append(
            (max(0.0, seconds / rows), abs(rows), self._steps[requests])
        )

    def _price(self, requests: int) -> float | None:
        """A draft row's seconds beside ``requests`` decoding ones: the median of the recent
        pairs' prices, each counted as many times as it has rows; None before ``MIN_ROWS`` rows
        of pairs younger than ``PRICE_STEPS`` steps."""
        oldest = self._steps.get(requests, 0) - PRICE_STEPS
        samples = sorted(
            (price, rows) for price, rows, step in self._samples.get(requests, ()) if step > oldest
        )
        total = sum(rows for _, rows in samples)
        if total < MIN_ROWS:
            return None
        counted = 0
        for price, rows in samples:
            counted += rows
            if 2 * counted >= total:
                return price
        raise AssertionError("unreachable: the counts reach the total")

    def series(self, batch: frozenset[str], count: int) -> list[float] | None:
        """Predicted seconds of ``batch``'s next step with 0 … ``count`` drafts; None until these
        requests' plain step is known: seen, or their latest step less its drafts where a draft
        row beside as many requests has a price. Drafts beside as many requests as not yet paired
        on ``MIN_ROWS`` rows are priced 0, so they run and are priced from then on (the step-time
        model, which would be asked instead, prices them by the steps that mislead it)."""
        if batch != self._batch:
            return None
        measured = self._price(len(batch))
        if self._plain is not None:
            plain, price = self._plain, measured or 0.0
        elif measured is not None and self._last is not None:
            price = measured
            plain = max(0.0, self._last[1] - self._last[0] * price)
        else:
            return None
        return [plain + i * price for i in range(count + 1)]

    def wants_probe(self, batch: frozenset[str], draft_rows: int) -> bool:
        """Whether ``batch``'s next step, about to run ``draft_rows`` drafts, should run fewer:
        it ran as many in each of its last ``STEADY_STEPS`` steps and nothing prices them (no plain
        step of its own, no price for as many requests)."""
        return (
            batch == self._batch
            and self._plain is None
            and self._price(len(batch)) is None
            and self._last is not None
            and self._last[0] == draft_rows > 0
            and self._steady >= STEADY_STEPS - 1
        )

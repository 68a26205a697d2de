"""An online model of one engine step's time as a function of the batch's composition.

    seconds ≈ c0 + c_prefill · prefill tokens + c_decode · decode sequences + c_attend · attended tokens
              + c_mixed · [the step has any prefill] + c_draft_row · draft rows
              + c_draft · draft-attended tokens (+ c_pass · extra weight passes)

``attended tokens`` is Σ (new tokens × context length after the step) over the batch: the work of
attention, which grows with context while the other terms do not. ``c_mixed`` is the fixed price of
leaving the pure-decode path: on CPUs with our kernels a pure decode step is one fused C++ call,
and any prefill chunk sends the whole step through the per-layer path, a cost several times the
decode step it joins whatever the chunk's size (docs/scheduling.md). A row verifying a
speculative draft runs as a one-token sequence whose keys, but its last few, are the keys of the
decode row before it, which the attention kernels read once for both: it costs arithmetic but
almost no memory traffic, a fraction of a decode row, so it has terms of its own (draft rows, and
``draft-attended tokens``, Σ their context lengths after the step); priced as decode rows, drafts
never ran beside a batch of long decodes. They are learnt from pure decode steps: in a mixed step
draft rows count as the decode rows they are. Terms never observed fit as 0, so a first draft is
predicted free, runs, and is priced from then on. ``c_pass`` (only for a model
built with ``pass_rows``) is the price of each further read of the weights a pure decode step of
more than ``pass_rows`` rows makes, where the decode kernels serve that many rows per read: on
such a CPU the row after a full pass costs several rows' time. The coefficients are an exact
least-squares fit over a sliding window of the latest observations (so the model follows drift:
another tenant on the device, thermal throttling), with non-negative slopes (a bigger batch never
predicts a shorter step). Pure Python: no torch, no clock; the caller supplies the seconds.
Invariant: ``predict`` is monotone in every feature and ``None`` until something was observed.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass

DEFAULT_WINDOW = 256
_NUM_TERMS = 7  # intercept + six features (eight terms with the weight passes)
_RIDGE = 1e-9  # per row, on RMS-scaled columns: keeps rank-deficient windows solvable


@dataclass(frozen=True, slots=True)
class StepFeatures:
    """What a step computes. Add two with ``+``; the empty step is ``StepFeatures()``."""

    num_prefill_tokens: int = 0  # tokens of chunks longer than one token (prompt or recompute)
    num_decode_seqs: int = 0  # sequences computing exactly one token (drafts' rows apart)
    num_attended_tokens: int = 0  # Σ new tokens × context length after the step (decode rows' and chunks')
    num_draft_rows: int = 0  # one-token rows verifying speculative drafts
    num_draft_attended_tokens: int = 0  # Σ context length after the step of the draft rows

    def __add__(self, other: StepFeatures) -> StepFeatures:
        return StepFeatures(
            self.num_prefill_tokens + other.num_prefill_tokens,
            self.num_decode_seqs + other.num_decode_seqs,
            self.num_attended_tokens + other.num_attended_tokens,
            self.num_draft_rows + other.num_draft_rows,
            self.num_draft_attended_tokens + other.num_draft_attended_tokens,
        )

    def row(self) -> tuple[float, ...]:
        return (
            1.0,
            float(self.num_prefill_tokens),
            float(self.num_decode_seqs),
            float(self.num_attended_tokens),
            1.0 if self.num_prefill_tokens > 0 else 0.0,
            float(self.num_draft_rows),
            float(self.num_draft_attended_tokens),
        )


def chunk_features(num_computed_tokens: int, num_new_tokens: int) -> StepFeatures:
    """Features of one request computing ``num_new_tokens`` after ``num_computed_tokens``."""
    if num_new_tokens <= 0:
        return StepFeatures()
    attended = num_new_tokens * (num_computed_tokens + num_new_tokens)
    if num_new_tokens == 1:
        return StepFeatures(0, 1, attended)
    return StepFeatures(num_new_tokens, 0, attended)


def draft_row_features(num_computed_tokens: int) -> StepFeatures:
    """Features of one row verifying a draft at position ``num_computed_tokens``: a one-token
    row whose attention re-reads the keys of the row before it."""
    return StepFeatures(0, 0, 0, 1, num_computed_tokens + 1)


def decode_features(num_computed_tokens: int, num_drafts: int) -> StepFeatures:
    """Features of a request decoding its next token after ``num_computed_tokens`` with
    ``num_drafts`` drafts: as the model runner lays it out, one one-token sequence per position,
    the rows after the first verifying drafts."""
    features = chunk_features(num_computed_tokens, 1)
    for index in range(1, 1 + num_drafts):
        features = features + draft_row_features(num_computed_tokens + index)
    return features


def batch_features(chunks: Iterable[tuple[int, int]]) -> StepFeatures:
    """Features of a batch of ``(num_computed_tokens, num_new_tokens)`` chunks."""
    total = StepFeatures()
    for num_computed, num_new in chunks:
        total = total + chunk_features(num_computed, num_new)
    return total


class StepCostModel:
    """Sliding-window non-negative least squares of step seconds on ``StepFeatures``.

    The normal equations are kept as running sums (added on arrival, subtracted on eviction and
    rebuilt from the window every ``window`` observations against rounding drift), so an update or
    a fit costs a few dozen float operations whatever the window.
    """

    def __init__(self, window: int = DEFAULT_WINDOW, pass_rows: int | None = None) -> None:
        if window < 1:
            raise ValueError(f"window: must be >= 1, got {window}")
        if pass_rows is not None and pass_rows < 1:
            raise ValueError(f"pass_rows: must be >= 1, got {pass_rows}")
        self.window = window
        self.pass_rows = pass_rows
        self._terms = _NUM_TERMS + (pass_rows is not None)
        self._rows: deque[tuple[tuple[float, ...], float]] = deque()
        self._decode_sizes: Counter[float] = Counter()  # pure decode steps in the window, by rows
        self._gram = [[0.0] * self._terms for _ in range(self._terms)]
        self._rhs = [0.0] * self._terms
        self._since_rebuild = 0
        self._coefficients: tuple[float, ...] | None = None
        self._stale = False

    @property
    def num_observations(self) -> int:
        return len(self._rows)

    def knows_decode_rows(self) -> bool:
        """Whether the window holds pure decode steps of two or more batch sizes: only then can the
        fit tell the price of one more decode row from the step's fixed cost."""
        return len(self._decode_sizes) >= 2

    def observe(self, features: StepFeatures, seconds: float) -> None:
        """Record one step; negative or non-finite times are ignored (a clock glitch, not data)."""
        if not 0.0 <= seconds < float("inf"):
            return
        row = self._row(features)
        self._rows.append((row, float(seconds)))
        self._count_size(row, 1)
        self._accumulate(row, float(seconds), 1.0)
        if len(self._rows) > self.window:
            old_row, old_seconds = self._rows.popleft()
            self._count_size(old_row, -1)
            self._accumulate(old_row, old_seconds, -1.0)
        self._since_rebuild += 1
        if self._since_rebuild >= self.window:
            self._rebuild()
        self._stale = True

    def _count_size(self, row: tuple[float, ...], sign: int) -> None:
        if row[1] == 0.0:  # no prefill: a pure decode step of row[2] decode rows
            self._decode_sizes[row[2]] += sign
            if self._decode_sizes[row[2]] <= 0:
                del self._decode_sizes[row[2]]

    def _row(self, features: StepFeatures) -> tuple[float, ...]:
        if features.num_prefill_tokens > 0 and features.num_draft_rows > 0:
            # A mixed step runs the per-layer path at a price of its own: its draft rows count as
            # the decode rows they are, so the draft terms are learnt from pure decode steps only
            # (the mixed steps' price, set on the few draft rows beside a prompt, made them 10x).
            features = StepFeatures(
                features.num_prefill_tokens,
                features.num_decode_seqs + features.num_draft_rows,
                features.num_attended_tokens + features.num_draft_attended_tokens,
            )
        row = features.row()
        if self.pass_rows is None:
            return row
        rows = features.num_decode_seqs + features.num_draft_rows
        return (*row, float(self._further_passes(rows) if features.num_prefill_tokens == 0 else 0))

    def _further_passes(self, rows: int) -> int:
        """Reads of the weights past the first that a pure decode step of ``rows`` rows makes."""
        assert self.pass_rows is not None
        return -(-rows // self.pass_rows) - 1 if rows > 0 else 0

    def _accumulate(self, row: tuple[float, ...], seconds: float, sign: float) -> None:
        for a in range(self._terms):
            self._rhs[a] += sign * row[a] * seconds
            for b in range(self._terms):
                self._gram[a][b] += sign * row[a] * row[b]

    def _rebuild(self) -> None:
        self._gram = [[0.0] * self._terms for _ in range(self._terms)]
        self._rhs = [0.0] * self._terms
        for row, seconds in self._rows:
            self._accumulate(row, seconds, 1.0)
        self._since_rebuild = 0

    @property
    def coefficients(self) -> tuple[float, ...] | None:
        """(c0, c_prefill, c_decode, c_attend, c_mixed, c_draft_row, c_draft[, c_pass]), or None
        before the first observation."""
        if self._stale:
            self._coefficients = _fit_nonnegative(self._gram, self._rhs, len(self._rows))
            self._stale = False
        return self._coefficients

    def predict(self, features: StepFeatures) -> float | None:
        """Predicted seconds for a step with these features; None before the first observation."""
        coefficients = self.coefficients
        if coefficients is None:
            return None
        return _dot(coefficients, self._row(features))

    def predict_adding(self, base: StepFeatures, added: StepFeatures, count: int) -> list[float] | None:
        """``predict(base + i · added)`` for i = 0 … ``count``, in one pass: the terms are linear
        in the features but for the weight passes, so only those are counted per i. Drafting
        prices every candidate count each step, where a ``predict`` per count showed in the
        profile of a step that drafts nothing."""
        coefficients = self.coefficients
        if coefficients is None:
            return None
        if base.num_prefill_tokens or added.num_prefill_tokens:  # a mixed step's rows are priced otherwise
            series, features = [], base
            for _ in range(count + 1):
                series.append(_dot(coefficients, self._row(features)))
                features = features + added
            return series
        terms = coefficients[:_NUM_TERMS]  # the weight passes' term apart
        start = _dot(terms, base.row())
        step = _dot(terms[1:], added.row()[1:])  # no intercept
        series = [start + i * step for i in range(count + 1)]
        if self.pass_rows is not None:
            rows, per = (
                base.num_decode_seqs + base.num_draft_rows,
                added.num_decode_seqs + added.num_draft_rows,
            )
            for i in range(count + 1):
                series[i] += coefficients[-1] * self._further_passes(rows + i * per)
        return series


def _dot(coefficients: tuple[float, ...], row: tuple[float, ...]) -> float:
    return sum(c * x for c, x in zip(coefficients, row, strict=True))


def _fit_nonnegative(gram: list[list[float]], rhs: list[float], num_rows: int) -> tuple[float, ...] | None:
    """Least squares with every coefficient >= 0: refit without the term that came out most negative."""
    if num_rows == 0:
        return None
    active = [True] * len(rhs)
    while True:
        solution = _fit(gram, rhs, num_rows, active)
        negative = [i for i in range(len(rhs)) if active[i] and solution[i] < 0.0]
        if not negative:
            return tuple(solution)
        worst = min(negative, key=lambda i: solution[i] * _scale(gram, num_rows, i))
        active[worst] = False


def _scale(gram: list[list[float]], num_rows: int, column: int) -> float:
    """Root mean square of a feature over the window (1 for a feature that was always 0)."""
    return math.sqrt(max(gram[column][column], 0.0) / num_rows) or 1.0


def _fit(gram: list[list[float]], rhs: list[float], num_rows: int, active: list[bool]) -> list[float]:
    """Ridge-stabilised normal equations on RMS-scaled columns; inactive terms are 0."""
    columns = [i for i in range(len(rhs)) if active[i]]
    scales = [_scale(gram, num_rows, i) for i in columns]
    matrix = [
        [gram[a][b] / (sa * sb) for b, sb in zip(columns, scales, strict=True)]
        for a, sa in zip(columns, scales, strict=True)
    ]
    for index in range(len(columns)):
        matrix[index][index] += _RIDGE * num_rows
    solved = _solve(matrix, [rhs[a] / sa for a, sa in zip(columns, scales, strict=True)])
    solution = [0.0] * len(rhs)
    for column, scale, value in zip(columns, scales, solved, strict=True):
        solution[column] = value / scale
    return solution


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (the matrix is symmetric positive definite)."""
    size = len(rhs)
    a = [[*row, rhs[i]] for i, row in enumerate(matrix)]
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, size):
            factor = a[r][col] / a[col][col]
            for k in range(col, size + 1):
                a[r][k] -= factor * a[col][k]
    solution = [0.0] * size
    for r in range(size - 1, -1, -1):
        tail = sum(a[r][k] * solution[k] for k in range(r + 1, size))
        solution[r] = (a[r][size] - tail) / a[r][r]
    return solution

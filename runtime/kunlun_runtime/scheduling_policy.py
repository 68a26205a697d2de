"""The feedback policy's decisions (seed §3.3.1): how much prefill a step may take, when the device
has room to merge a small request, and how much of a request's KV is already resident.

Pure: it reads a ``StepCostModel`` (fed by the scheduler from the engine's measured step times) and
optionally a utilisation reader; it never touches torch, the clock or the block pool's state.
Invariant: every cap it returns lets a step make progress (at least ``min_prefill_chunk`` prefill
tokens when the batch has none yet), so the time target can slow a request down but never stop it.
"""

from __future__ import annotations

from collections.abc import Callable

from kunlun_runtime.kv.kv_manager import KVManager
from kunlun_runtime.kv.prefix_hash import hash_full_blocks
from kunlun_runtime.request import Request
from kunlun_runtime.step_cost import StepCostModel, StepFeatures, chunk_features

POLICIES = frozenset({"fixed", "feedback"})
# With no explicit target, a step that carries decodes may take this many pure-decode steps: the
# inter-token latency a running request sees at most triples while prompts are being prefilled...
DEFAULT_TARGET_DECODE_STEPS = 3.0
# ...or, where a step with any prefill has a fixed price (``c_mixed``: the per-layer path instead
# of the one-call decode stack), the pure-decode step plus this many times that price, so that a
# capped chunk's own work is at least four times the price (prefill at >= 80 % of its uncapped
# efficiency). Three decode steps alone measured chunks spent mostly on the price: prefill slowed
# down enough to lose throughput and p99 TTFT under load (docs/scheduling.md).
DEFAULT_TARGET_MIXED_PRICES = 5.0
# ...and never below this (at this bound a stream still gets about three tokens a second while
# prompts are prefilled). The two learned terms above move with every refit of the step-time
# model; on the document QA benchmark they alone won in one seeded run and lost in the other,
# while this bound as an explicit target won both (docs/scheduling.md).
DEFAULT_MIN_TARGET_SECONDS = 0.3
# A small request (whole prompt in one step) may be merged past the target by this fraction: its
# cost is mostly the step's fixed overhead, which it shares with the batch.
MERGE_SLACK_RATIO = 0.5
# Below this utilisation the device idles between steps: any request that fits is merged.
UNDERUSED_UTILIZATION_RATIO = 0.5
DEFAULT_MIN_PREFILL_CHUNK = 16
# The largest chunk the amortization rule may demand (the token budget caps it anyway).
AMORTIZE_LIMIT = 1 << 20
# A request that does not fit may be overtaken by small ones for at most this many of its waiting
# steps (or priority_aging_steps, if fewer); then it blocks the queue as under the fixed policy.
MAX_OVERTAKEN_STEPS = 16


class FeedbackPolicy:
    """Time-aware batch decisions on top of the scheduler's token and memory limits."""

    def __init__(
        self,
        cost: StepCostModel,
        target_step_seconds: float | None = None,
        utilization: Callable[[], float | None] | None = None,
        min_prefill_chunk: int = DEFAULT_MIN_PREFILL_CHUNK,
    ) -> None:
        self.cost = cost
        self.target_step_seconds = target_step_seconds
        self.utilization = utilization
        self.min_prefill_chunk = min_prefill_chunk
        self._hashes: dict[str, tuple[int, list[int]]] = {}  # request id → (tokens hashed, hashes)

    def step_target(self, decodes: StepFeatures) -> float | None:
        """Seconds a step carrying ``decodes`` may take; None = no cap (no decode is waiting on it,
        or nothing has been measured yet)."""
        if decodes.num_decode_seqs == 0:
            return None
        if self.target_step_seconds is not None:
            return self.target_step_seconds
        predicted = self.cost.predict(decodes)
        if predicted is None:
            return None
        c_mixed = self.cost.coefficients[4]
        return max(
            DEFAULT_TARGET_DECODE_STEPS * predicted,
            predicted + DEFAULT_TARGET_MIXED_PRICES * c_mixed,
            DEFAULT_MIN_TARGET_SECONDS,
        )

    def prefill_cap(
        self, batch: StepFeatures, target: float | None, num_computed: int, num_remaining: int, budget: int
    ) -> int:
        """The largest chunk of a prefill (``num_remaining`` tokens left after ``num_computed``)
        that keeps the predicted step time of ``batch`` plus the chunk within ``target``.

        Never more than ``budget`` tokens; when ``batch`` holds no prefill yet, at least
        ``min_prefill_chunk`` (or what is left), so that prefills always progress, and at least
        enough tokens that the chunk's own work pays the fixed price of a step with prefill
        (``amortized_chunk``); 0 when the step is full.
        """
        limit = min(num_remaining, budget)
        if limit <= 0 or target is None or self.cost.coefficients is None:
            return max(limit, 0)
        floor = 0
        if batch.num_prefill_tokens == 0:
            floor = min(limit, max(self.min_prefill_chunk, self.amortized_chunk()))
        if self._predict(batch, num_computed, limit) <= target:
            return limit
        low, high = floor, limit  # invariant: low fits (or is the floor), high does not
        while high - low > 1:
            middle = (low + high) // 2
            if self._predict(batch, num_computed, middle) <= target:
                low = middle
            else:
                high = middle
        return low

    def amortized_chunk(self) -> int:
        """Prefill tokens whose work equals the fixed price of leaving the pure-decode path
        (``c_mixed / c_prefill``): a smaller chunk would spend most of its step on that price."""
        coefficients = self.cost.coefficients
        if coefficients is None:
            return 0
        c_prefill, c_mixed = coefficients[1], coefficients[4]
        if c_mixed <= 0.0:
            return 0
        return AMORTIZE_LIMIT if c_prefill <= 0.0 else min(AMORTIZE_LIMIT, round(c_mixed / c_prefill))

    def can_merge(
        self, batch: StepFeatures, target: float | None, num_computed: int, num_tokens: int
    ) -> bool:
        """Whether a small request's whole prefill fits into this step: within the target plus the
        merge slack, or on a device that reports it is under-used."""
        if target is None:
            return True
        utilization = self.utilization() if self.utilization is not None else None
        if utilization is not None and utilization < UNDERUSED_UTILIZATION_RATIO:
            return True
        return self._predict(batch, num_computed, num_tokens) <= target * (1.0 + MERGE_SLACK_RATIO)

    def _predict(self, batch: StepFeatures, num_computed: int, num_new: int) -> float:
        predicted = self.cost.predict(batch + chunk_features(num_computed, num_new))
        return 0.0 if predicted is None else predicted

    def resident_blocks(self, kv: KVManager, request: Request) -> int:
        """How many of the request's leading full blocks are in the prefix cache now (the same
        match as ``KVManager.find_cached_prefix``, without counting it as a cache query)."""
        if not kv.enable_prefix_caching or request.wants_prompt_logprobs:
            return 0
        tokens = request.all_token_ids
        num_hashed, hashes = self._hashes.get(request.request_id, (-1, []))
        if num_hashed != len(tokens):
            hashes = hash_full_blocks(tokens[: len(tokens) - 1], kv.block_size, request.cache_salt)
            self._hashes[request.request_id] = (len(tokens), hashes)
        count = 0
        for block_hash in hashes:
            if kv.pool.lookup(block_hash) is None:
                break
            count += 1
        return count

    def forget(self, request_id: str) -> None:
        """Drop what is remembered about a finished request."""
        self._hashes.pop(request_id, None)

"""The profiler: measures the real engine on the real model, within a time budget.

Sweeps, each through ``LLMEngine.step()`` (scheduling, model, sampling: what serving pays):

1. prefill: one sequence of N tokens in one step, N doubling from 16 (step time, peak memory);
2. decode: S sequences of ``DECODE_CONTEXT`` tokens decoding together, S doubling from 1;
3. block sizes: decode of ``BLOCK_SWEEP_SEQS`` sequences × ``BLOCK_SWEEP_CONTEXT`` tokens with each
   KV block size the engine supports (one engine per size), and the KV bytes per token each costs.

Prefix caching is off while profiling (repeated prompts must not hit the cache); prompts are
random token ids. A point's time is the best of its repeats: on a shared machine contention only
ever adds time. Each sweep stops when its next point would overrun its share of the budget
(``Budget``); what was left out is listed in ``Measurements.skipped``.
"""

from __future__ import annotations

import gc
import logging
import random
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import psutil  # no types-psutil in the dev extras yet
import torch

from kunlun_runtime.config import DeviceName, DTypeName, EngineConfig
from kunlun_runtime.engine.llm_engine import LLMEngine
from kunlun_runtime.engine.sampling_params import SamplingParams
from kunlun_runtime.kv.block_layout import build_block_layout
from kunlun_runtime.kv.cache import KVCacheSpec
from kunlun_runtime.kv.kv_dtype import resolve_kv_cache_dtype
from kunlun_runtime.models.model_config import load_model_config
from kunlun_runtime.models.model_dir import resolve_model_dir
from kunlun_runtime.platforms import detect
from kunlun_runtime.platforms.dtypes import resolve_dtype
from kunlun_runtime.tuning.budget import Budget
from kunlun_runtime.tuning.facts import count_cards, model_bytes, part_bytes
from kunlun_runtime.tuning.measurements import (
    BlockSizePoint,
    DecodePoint,
    Measurements,
    ModelFacts,
    ModelParts,
    PlatformFacts,
    PrefillPoint,
)
from kunlun_runtime.tuning.targets import TuningError

logger = logging.getLogger(__name__)
T = TypeVar("T")

PREFILL_TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
DECODE_SEQS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DECODE_CONTEXT = 64
BLOCK_SIZES = (16, 8, 32, 64, 128)  # 16 first: measured on the engine the other sweeps used
BLOCK_SWEEP_SEQS = 8
BLOCK_SWEEP_CONTEXT = 256
MAX_REPEATS = 3
DECODE_TOKENS = 12  # tokens each decode-point sequence may generate (the timed steps need MAX_REPEATS)
SLOW_STEP_SECONDS = 1.0  # two runs of a step this slow are enough
GROWTH_MARGIN = 1.25  # predicted costs are raised by this factor


@dataclass(frozen=True, slots=True)
class ProfileOptions:
    model: str | None = None  # HF-format directory; None = the embedded default model
    device: DeviceName = "auto"
    dtype: DTypeName = "auto"
    max_model_len: int | None = None  # the context length to plan KV memory for (default: the model's)
    budget_seconds: float = 60.0
    seed: int = 0


def predict_cost(costs: list[tuple[int, float]], size: int) -> float:
    """Cost of measuring ``size``, extrapolated linearly from the last two (size, seconds) points
    (one point: proportional to size), never below the last cost, with a safety margin."""
    last_size, last_cost = costs[-1]
    if len(costs) == 1:
        slope = last_cost / last_size
    else:
        before_size, before_cost = costs[-2]
        slope = max(0.0, (last_cost - before_cost) / (last_size - before_size))
    return max(last_cost, last_cost + slope * (size - last_size)) * GROWTH_MARGIN


class Profiler:
    def __init__(self, options: ProfileOptions) -> None:
        self.options = options
        self.budget = Budget(options.budget_seconds)
        self.platform = detect(options.device)
        self.model_dir = resolve_model_dir(options.model)
        self.model_config = load_model_config(self.model_dir)
        self.rng = random.Random(options.seed)
        self.skipped: list[str] = []
        limit = self.model_config.max_position_embeddings
        window = self.model_config.sliding_window
        self.target_len = options.max_model_len or (min(limit, window) if window else limit)
        self.prefill_sizes = [n for n in PREFILL_TOKENS if n + 2 <= limit]
        self.context = min(DECODE_CONTEXT, limit // 2)
        self.block_context = min(BLOCK_SWEEP_CONTEXT, limit // 2)

    # -- engines ---------------------------------------------------------------------------------
    def _engine(self, block_size: int, demands: tuple[tuple[int, int], ...], max_tokens: int) -> LLMEngine:
        """An engine whose KV cache holds each demand (num_seqs sequences of so many tokens) and one
        prefill of ``max_tokens`` in one step."""
        mc = self.model_config
        profile_len = min(mc.max_position_embeddings, max(max_tokens + 2, *(t for _, t in demands)))
        blocks = max(-(-profile_len // block_size), *(n * -(-t // block_size) for n, t in demands)) + 4
        num_seqs = max(n for n, _ in demands)
        # every demand prefills in one step, so its sequences start decoding together
        batched = max(max_tokens, *(n * t for n, t in demands))
        config = EngineConfig(
            model=str(self.model_dir),
            device=self.options.device,
            dtype=self.options.dtype,
            block_size=block_size,
            max_num_seqs=num_seqs,
            max_num_batched_tokens=batched,
            kv_cache_memory_bytes=blocks * self.kv_block_bytes(block_size),
            max_model_len=profile_len,
            enable_prefix_caching=False,
            seed=self.options.seed,
        )
        return LLMEngine(config)

    def kv_block_bytes(self, block_size: int) -> int:
        """One KV block of all layers (K and V), padded as the engine lays it out on this platform."""
        mc = self.model_config
        dtype = resolve_dtype(self.options.dtype, self.platform)
        kv_dtype = resolve_kv_cache_dtype(
            "auto", dtype, self.platform, dtype_is_auto=self.options.dtype == "auto"
        )
        spec = KVCacheSpec.for_model(mc, block_size, kv_dtype)
        layout = build_block_layout(
            spec.block_bytes,
            cache_line_bytes=self.platform.cache_line_bytes,
            cache_num_sets=self.platform.cache_num_sets,
            skew=True,
        )
        return 2 * mc.num_layers * layout.stride_bytes

    def _tokens(self, count: int) -> list[int]:
        return [self.rng.randrange(self.model_config.vocab_size) for _ in range(count)]

    def _timed_step(self, engine: LLMEngine) -> tuple[float, int]:
        self.platform.synchronize()
        start = time.perf_counter()
        outputs = engine.step()
        self.platform.synchronize()
        return time.perf_counter() - start, len(outputs)

    def _memory_mark(self) -> int:
        if self.platform.device_type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated()
        return psutil.Process().memory_info().rss

    def _memory_growth(self, mark: int) -> int:
        """Peak memory above ``mark`` since it was taken (CPU: an upper bound from peak RSS)."""
        if self.platform.device_type == "cuda":
            return max(0, torch.cuda.max_memory_allocated() - mark)
        return max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - mark)

    # -- points ----------------------------------------------------------------------------------
    def prefill_point(self, engine: LLMEngine, num_tokens: int) -> PrefillPoint:
        times, peak = [], 0
        for repeat in range(MAX_REPEATS):
            engine.add_request(
                f"tune-prefill-{num_tokens}-{repeat}",
                self._tokens(num_tokens),
                SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
            )
            mark = self._memory_mark()
            seconds, _ = self._timed_step(engine)
            peak = max(peak, self._memory_growth(mark))
            while engine.has_unfinished_requests():
                engine.step()
            times.append(seconds)
            if seconds > SLOW_STEP_SECONDS and len(times) >= 2:
                break
        return PrefillPoint(num_tokens, round(min(times), 6), len(times), peak)

    def decode_point(self, engine: LLMEngine, num_seqs: int, context: int) -> DecodePoint:
        ids = [f"tune-decode-{num_seqs}-{context}-{i}" for i in range(num_seqs)]
        # The engine refuses a max_tokens beyond the context (it no longer cuts it short).
        max_tokens = min(DECODE_TOKENS, engine.max_model_len - context)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for request_id in ids:
            engine.add_request(request_id, self._tokens(context), params)
        started: set[str] = set()
        while len(started) < num_seqs:  # prefill every sequence (perhaps over several steps)
            started.update(output.request_id for output in engine.step())
        times = []
        for _ in range(DECODE_TOKENS - 2):
            seconds, num_outputs = self._timed_step(engine)
            if num_outputs == num_seqs:  # only steps that decode every sequence count
                times.append(seconds)
            if len(times) == MAX_REPEATS or (seconds > SLOW_STEP_SECONDS and len(times) >= 2):
                break
        if not times:
            raise TuningError(f"tune: no step decoded all {num_seqs} sequences together")
        for request_id in ids:
            engine.abort_request(request_id)
        return DecodePoint(num_seqs, context, round(min(times), 6), len(times))

    def block_point(self, engine: LLMEngine) -> BlockSizePoint:
        point = self.decode_point(engine, BLOCK_SWEEP_SEQS, self.block_context)
        block_size = engine.config.block_size
        block_bytes = 2 * self.model_config.num_layers * engine.kv_cache.layout.stride_bytes
        assert block_bytes == self.kv_block_bytes(block_size), "the profiler plans the engine's layout"
        per_token = -(-block_bytes // block_size)
        return BlockSizePoint(
            block_size, point.num_seqs, point.context_tokens, point.step_seconds, per_token, point.repeats
        )

    # -- sweeps ----------------------------------------------------------------------------------
    def _sweep(
        self, name: str, sizes: list[int], measure: Callable[[int], T], first_cost: float | None = None
    ) -> list[T]:
        """Measure ``sizes`` in order while the budget's phase allows the next point. The first point
        always runs unless ``first_cost`` predicts it too long; later ones are predicted from the
        cost of the points before (``predict_cost``)."""
        points: list[T] = []
        costs: list[tuple[int, float]] = []
        for index, size in enumerate(sizes):
            predicted = first_cost if not costs else predict_cost(costs, size)
            if predicted is not None and not self.budget.allows(predicted):
                self.skipped += [f"{name} {s} (budget)" for s in sizes[index:]]
                break
            start = time.perf_counter()
            points.append(measure(size))
            costs.append((size, time.perf_counter() - start))
            logger.info("tune: %s %d: %.1f s", name, size, costs[-1][1])
        return points

    @staticmethod
    def _block_point_cost(prefill: list[PrefillPoint], decode: list[DecodePoint]) -> float:
        """Predicted cost of one block-size point: prefilling its sequences, then decoding them."""
        tokens = BLOCK_SWEEP_SEQS * BLOCK_SWEEP_CONTEXT
        last_decode = decode[-1]
        decode_step = last_decode.step_seconds * max(1.0, BLOCK_SWEEP_SEQS / last_decode.num_seqs)
        return tokens / prefill[-1].tokens_per_second + MAX_REPEATS * decode_step

    def run(self) -> Measurements:
        """Run the three sweeps; the whole run is bounded by ``options.budget_seconds``."""
        free_before = self.platform.free_memory_bytes()
        extra = DECODE_TOKENS + 2  # tokens each sequence grows by while it is measured
        demands = ((max(DECODE_SEQS), self.context + extra), (BLOCK_SWEEP_SEQS, self.block_context + extra))
        engines = {16: self._engine(16, demands, self.prefill_sizes[-1])}
        warm_up = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        engines[16].add_request("tune-warm-up", self._tokens(16), warm_up)  # not recorded
        while engines[16].has_unfinished_requests():
            engines[16].step()
        model, parts = self._model_facts(engines[16]), self._model_parts(engines[16])
        self.budget.phase(0.35)
        prefill = self._sweep(
            "prefill tokens", self.prefill_sizes, lambda n: self.prefill_point(engines[16], n)
        )
        self.budget.phase(0.55)
        decode = self._sweep(
            "decode seqs", list(DECODE_SEQS), lambda s: self.decode_point(engines[16], s, self.context)
        )
        self.budget.phase(1.0)

        def block_measure(block_size: int) -> BlockSizePoint:
            if block_size not in engines:
                engines.clear()  # one engine at a time
                gc.collect()
                tokens = self.block_context + extra
                engines[block_size] = self._engine(block_size, ((BLOCK_SWEEP_SEQS, tokens),), tokens)
            return self.block_point(engines[block_size])

        first_cost = self._block_point_cost(prefill, decode)
        blocks = self._sweep("block size", list(BLOCK_SIZES), block_measure, first_cost)
        engines.clear()
        return Measurements(
            platform=self._platform_facts(free_before),
            model=model,
            prefill=tuple(prefill),
            decode=tuple(decode),
            block_sizes=tuple(blocks),
            kv_block_bytes={size: self.kv_block_bytes(size) for size in sorted(BLOCK_SIZES)},
            budget_seconds=self.options.budget_seconds,
            elapsed_seconds=round(self.budget.elapsed(), 3),
            skipped=tuple(self.skipped),
            parts=parts,
        )

    def _model_facts(self, engine: LLMEngine) -> ModelFacts:
        mc = engine.model_config
        narrower_weights = engine.weight_dtype != engine.dtype
        return ModelFacts(
            name=self.model_dir.name,
            dtype=str(engine.dtype).removeprefix("torch."),
            weight_dtype=str(engine.weight_dtype).removeprefix("torch.") if narrower_weights else None,
            num_layers=mc.num_layers,
            num_heads=mc.num_heads,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            weight_bytes=model_bytes(engine.model),
            max_model_len=self.target_len,
        )

    @staticmethod
    def _model_parts(engine: LLMEngine) -> ModelParts | None:
        parts = part_bytes(engine.model)
        if parts is None:
            return None
        mc = engine.model_config
        return ModelParts(mc.hidden_size, mc.intermediate_size, mc.vocab_size, *parts)

    def _platform_facts(self, free_before: int) -> PlatformFacts:
        if self.platform.name == "cpu":
            memory, source = free_before, "host memory available before loading"
        else:
            memory, source = self.platform.total_memory_bytes(), "device memory per card"
        return PlatformFacts(self.platform.name, count_cards(self.platform), memory, source)

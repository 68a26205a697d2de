"""From measurements to a recommended engine configuration: a pure function, every choice explained.

The rules (each reason in the output quotes the numbers it used):

- ``max_num_seqs``: the largest measured decode batch whose step (the inter-token latency every
  running request sees) stays within the decode-step target, or within ``decode_slowdown_limit``
  times the smallest batch's step where even that misses the target (slow hardware).
- ``max_num_batched_tokens``: the knee of prefill throughput — the smallest measured chunk reaching
  ``prefill_knee_ratio`` of the best tokens/s (larger chunks only lengthen the steps that running
  decodes wait for), capped by ``max_prefill_step_seconds``, and never below ``max_num_seqs``.
- ``block_size``: among block sizes whose decode step is within ``block_size_tolerance`` of the
  fastest, the one with the least KV memory per token (padding included), then the smallest.
- ``tensor_parallel_size``: the smallest TP size (head counts divisible, at most the card count)
  at which one card holds its share of the weights, the measured activations and the KV of one
  ``max_model_len`` sequence within ``memory_fraction`` of its memory.
- ``kv_cache_memory_bytes``: the room left on a card at that TP size, but no more than
  ``max_num_seqs`` full-length sequences can use.

Nothing here measures, imports torch or reads the clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kunlun_runtime.errors import KunlunRuntimeError
from kunlun_runtime.tuning.measurements import (
    BlockSizePoint,
    DecodePoint,
    Measurements,
    ModelFacts,
    PrefillPoint,
)

MIB = 1 << 20
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class TuningError(KunlunRuntimeError):
    """The measurements cannot support a configuration (nothing measured, or the model cannot fit)."""


@dataclass(frozen=True, slots=True)
class Targets:
    """What the recommendation aims for."""

    memory_fraction: float = 0.9
    decode_step_target_seconds: float = 0.1
    decode_slowdown_limit: float = 2.0
    prefill_knee_ratio: float = 0.9
    max_prefill_step_seconds: float = 0.5
    block_size_tolerance: float = 0.1
    tp_sizes: tuple[int, ...] = (1, 2, 4, 8)


@dataclass(frozen=True, slots=True)
class Recommendation:
    options: dict[str, Any]  # EngineConfig field names → values
    reasons: dict[str, str]  # the same keys → why, with the numbers


def size(num_bytes: float) -> str:
    """Bytes for people: ``1.50 GiB``, ``12.0 MiB``, ``512 B``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", 1 << 10)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{int(num_bytes)} B"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def choose_num_seqs(points: tuple[DecodePoint, ...], targets: Targets) -> tuple[int, str]:
    ordered = sorted(points, key=lambda p: p.num_seqs)
    first = ordered[0]
    slowdown = targets.decode_slowdown_limit * first.step_seconds
    limit = max(targets.decode_step_target_seconds, slowdown)
    rule = (
        f"the {_ms(targets.decode_step_target_seconds)} target"
        if limit == targets.decode_step_target_seconds
        else f"{targets.decode_slowdown_limit:g}× the {first.num_seqs}-sequence step ({_ms(slowdown)})"
    )
    chosen = [p for p in ordered if p.step_seconds <= limit][-1]  # the first always qualifies
    reason = (
        f"largest measured decode batch whose step stays within {rule}: {chosen.num_seqs} sequences "
        f"in {_ms(chosen.step_seconds)} ({chosen.tokens_per_second:.0f} tokens/s)"
    )
    above = [p for p in ordered if p.num_seqs > chosen.num_seqs]
    if above:
        reason += f"; {above[0].num_seqs} took {_ms(above[0].step_seconds)}"
    else:
        reason += " (the largest batch measured)"
    return chosen.num_seqs, reason


def choose_batched_tokens(
    points: tuple[PrefillPoint, ...], num_seqs: int, targets: Targets
) -> tuple[int, PrefillPoint, str]:
    ordered = sorted(points, key=lambda p: p.num_tokens)
    best = max(ordered, key=lambda p: p.tokens_per_second)
    floor = targets.prefill_knee_ratio * best.tokens_per_second
    knee = next(p for p in ordered if p.tokens_per_second >= floor)
    reason = (
        f"smallest measured prefill reaching {targets.prefill_knee_ratio:.0%} of the best throughput "
        f"({best.tokens_per_second:.0f} tokens/s at {best.num_tokens} tokens): {knee.num_tokens} tokens in "
        f"{_ms(knee.step_seconds)} ({knee.tokens_per_second:.0f} tokens/s)"
    )
    chosen = knee
    cap = targets.max_prefill_step_seconds
    if knee.step_seconds > cap:
        capped = [p for p in ordered if p.step_seconds <= cap]
        if capped:
            chosen = capped[-1]
            reason += (
                f"; capped to {chosen.num_tokens} tokens ({_ms(chosen.step_seconds)}) to keep a prefill step "
                f"within {_ms(cap)}"
            )
        else:
            chosen = ordered[0]
            reason += (
                f"; no measured prefill step is within {_ms(cap)}: the smallest, {chosen.num_tokens} tokens "
                f"({_ms(chosen.step_seconds)})"
            )
    tokens = chosen.num_tokens
    if tokens < num_seqs:
        tokens = num_seqs
        reason += f"; raised to max_num_seqs={num_seqs} so that one step can decode every running sequence"
    return tokens, chosen, reason


def kv_bytes_per_token(model: ModelFacts) -> int:
    """K and V of all layers for one token, without block padding."""
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * DTYPE_BYTES[model.dtype]


def choose_block_size(points: tuple[BlockSizePoint, ...], targets: Targets) -> tuple[int, str]:
    if not points:
        return 16, "block sizes not measured (budget); the engine's default"
    fastest = min(points, key=lambda p: p.decode_step_seconds)
    limit = fastest.decode_step_seconds * (1 + targets.block_size_tolerance)
    candidates = [p for p in points if p.decode_step_seconds <= limit]
    chosen = min(candidates, key=lambda p: (p.kv_bytes_per_token, p.block_size))
    by_size = sorted(points, key=lambda p: p.block_size)
    timings = ", ".join(f"{p.block_size}: {_ms(p.decode_step_seconds)}" for p in by_size)
    reason = (
        f"decode of {chosen.num_seqs} sequences × {chosen.context_tokens} tokens by block size: {timings}; "
        f"within {targets.block_size_tolerance:.0%} of the fastest ({fastest.block_size}), "
        f"{chosen.block_size} needs the least KV memory per token "
        f"({chosen.kv_bytes_per_token} B, padding included)"
    )
    return chosen.block_size, reason


def _valid_tp_sizes(m: Measurements, targets: Targets) -> list[int]:
    heads, kv_heads = m.model.num_heads, m.model.num_kv_heads
    return [
        tp
        for tp in targets.tp_sizes
        if tp <= m.platform.num_cards and heads % tp == 0 and (kv_heads % tp == 0 or tp % kv_heads == 0)
    ]


def choose_memory(
    m: Measurements, num_seqs: int, block_size: int, block_bytes: int, activation_bytes: int, targets: Targets
) -> tuple[int, int, str, str]:
    """Returns (TP size, KV cache bytes per card, TP reason, KV reason).

    ``block_bytes``: one KV block of all layers on one card at TP 1, padding included.
    """
    model, platform = m.model, m.platform
    blocks_per_seq = -(-model.max_model_len // block_size)
    budget = int(targets.memory_fraction * platform.memory_bytes_per_card)
    valid = _valid_tp_sizes(m, targets)
    for tp in valid:
        card_block = -(-block_bytes * max(1, model.num_kv_heads // tp) // model.num_kv_heads)
        weights = -(-model.weight_bytes // tp)
        room = budget - weights - activation_bytes
        one_seq = blocks_per_seq * card_block
        if room >= one_seq:
            break
    else:
        raise TuningError(
            f"the model does not fit: weights {size(model.weight_bytes)} + "
            f"activations {size(activation_bytes)} + one {model.max_model_len}-token sequence of KV "
            f"exceed {targets.memory_fraction:.0%} of "
            f"{size(platform.memory_bytes_per_card)} per card at every TP size in {valid} "
            f"({platform.num_cards} card(s)); lower max_model_len or use more cards"
        )
    useful = num_seqs * one_seq
    kv = min(room, useful)
    kv = max(one_seq, kv // MIB * MIB) if kv >= MIB else kv
    tp_reason = (
        f"smallest TP size (of {valid}) at which a card holds its weights ({size(weights)}), activations "
        f"({size(activation_bytes)}) and one {model.max_model_len}-token sequence of KV ({size(one_seq)}) "
        f"within {targets.memory_fraction:.0%} of {size(platform.memory_bytes_per_card)} "
        f"({platform.memory_source}); {platform.num_cards} card(s) here"
    )
    kv_reason = (
        f"min(room left on a card: {size(room)}, KV of max_num_seqs={num_seqs} sequences of "
        f"max_model_len={model.max_model_len}: {size(useful)}); holds {kv // card_block * block_size} tokens "
        f"({kv / one_seq:.1f} full-length sequences) at {card_block / block_size:g} B/token per card"
    )
    return tp, kv, tp_reason, kv_reason


def recommend(m: Measurements, targets: Targets | None = None) -> Recommendation:
    """The recommended engine options for ``m`` and the reason for each.

    Raises:
        TuningError: no prefill or decode measurement, or the model cannot fit on the cards.
    """
    targets = targets or Targets()
    if not m.prefill or not m.decode:
        raise TuningError("tune: no prefill or decode step was measured; raise --budget-s")
    num_seqs, seqs_reason = choose_num_seqs(m.decode, targets)
    tokens, prefill_point, tokens_reason = choose_batched_tokens(m.prefill, num_seqs, targets)
    block_size, block_reason = choose_block_size(m.block_sizes, targets)
    block_bytes = m.kv_block_bytes.get(block_size) or block_size * kv_bytes_per_token(m.model)
    activation = prefill_point.peak_memory_bytes or 0
    tp, kv, tp_reason, kv_reason = choose_memory(m, num_seqs, block_size, block_bytes, activation, targets)
    options = {
        # Weights narrower than the activations are what only `auto` gives: an explicit dtype
        # would keep the weights in it, with twice the bytes that were measured.
        "dtype": "auto" if m.model.weight_dtype else m.model.dtype,
        "max_model_len": m.model.max_model_len,
        "block_size": block_size,
        "max_num_seqs": num_seqs,
        "max_num_batched_tokens": tokens,
        "kv_cache_memory_bytes": kv,
        "tensor_parallel_size": tp,
    }
    reasons = {
        "dtype": f"the dtype the measurements were taken in ({m.platform.name}'s default unless --dtype)",
        "max_model_len": "the context length the KV memory is planned for",
        "block_size": block_reason,
        "max_num_seqs": seqs_reason,
        "max_num_batched_tokens": tokens_reason,
        "kv_cache_memory_bytes": kv_reason,
        "tensor_parallel_size": tp_reason,
    }
    return Recommendation(options, reasons)

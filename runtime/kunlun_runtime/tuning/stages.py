"""How the model falls on one card at T tensor-parallel × P pipeline-parallel ranks: pure arithmetic.

The engine splits the decoder layers into P contiguous stages balanced by parameter bytes (the
embedding with the first stage, the final norm and ``lm_head`` with the last) and each stage's
layers T ways by heads and intermediate columns; the embedding, norms and ``lm_head`` are
replicated on every TP rank (``models/sharding.py``). So one card of a stage holds 1/T of its
layers' weights, the whole of its ends, and the KV of its own layers for its 1/T of the KV heads.

Nothing here measures, imports torch or chooses a size: the recommender does. Invariant: every
stage has at least one layer and the stages' layers add up to the model's.
"""

from __future__ import annotations

from dataclasses import dataclass

from kunlun_runtime.tuning.measurements import ModelFacts, ModelParts

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class Stage:
    """One pipeline stage as any one of its T cards sees it."""

    num_layers: int
    weight_bytes: int  # on one card: its TP share of the stage's layers plus the replicated ends
    kv_block_bytes: int  # one KV block of the stage's layers for this card's KV heads


def valid_tp_sizes(
    model: ModelFacts, parts: ModelParts | None, candidates: tuple[int, ...], num_cards: int
) -> list[int]:
    """The TP sizes of ``candidates`` that fit ``num_cards`` and divide the head counts and the
    intermediate size (when known), as ``models.sharding.validate_tensor_parallel`` requires."""
    counts = [model.num_heads, model.num_kv_heads]
    if parts is not None:
        counts.append(parts.intermediate_size)
    return [tp for tp in candidates if tp <= num_cards and all(count % tp == 0 for count in counts)]


def split_layers(
    num_layers: int, layer_bytes: int, first_bytes: int, last_bytes: int, num_stages: int
) -> tuple[int, ...]:
    """Layers per stage, contiguous and at least one each, minimising the largest stage's bytes.

    A stage's bytes are its layers × ``layer_bytes``, plus ``first_bytes`` on the first stage and
    ``last_bytes`` on the last (both on a single stage). Among the splits with the least maximum,
    later stages take the most layers (the first stage's leader also schedules and samples): the
    split ``parallel.layout.split_layers`` makes for layers all alike.

    Raises:
        ValueError: ``num_stages`` is not between 1 and ``num_layers``.
    """
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages")
    layer_bytes = max(1, layer_bytes)
    extras = [0] * num_stages
    extras[0] += first_bytes
    extras[-1] += last_bytes

    def capacities(limit: int) -> list[int]:
        return [(limit - extra) // layer_bytes for extra in extras]

    low, high = 0, num_layers * layer_bytes + first_bytes + last_bytes  # high: everything fits
    while low < high:  # the least limit at which every stage takes a layer and all layers fit
        middle = (low + high) // 2
        caps = capacities(middle)
        if min(caps) >= 1 and sum(caps) >= num_layers:
            high = middle
        else:
            low = middle + 1
    caps, layers, left = capacities(low), [0] * num_stages, num_layers
    for stage in reversed(range(num_stages)):  # from the last: as many as fit, one left per earlier stage
        layers[stage] = left if stage == 0 else min(caps[stage], left - stage)
        left -= layers[stage]
    return tuple(layers)


def plan_stages(
    model: ModelFacts, parts: ModelParts | None, block_bytes: int, tp: int, pp: int
) -> tuple[Stage, ...]:
    """The P stages at TP ``tp``, each as one of its cards sees it.

    ``block_bytes``: one KV block of all layers on one card at TP 1, padding included. Without
    ``parts`` (measurements from before they were recorded) the weights are taken as spread evenly
    over the layers, all of them split T ways.
    """
    n = model.num_layers
    if parts is None:
        layers = split_layers(n, 1, 0, 0, pp)
        weights = [-(-model.weight_bytes * k // (n * tp)) for k in layers]
    else:
        layer, first, last = parts.layer_bytes, parts.embedding_bytes, parts.head_bytes
        layers = split_layers(n, layer, first, last, pp)  # the engine balances whole stages, not cards
        ends = [0] * pp
        ends[0] += first
        ends[-1] += last
        if pp == 1:  # a tied lm_head is the embedding's storage: the measured total counts it once
            ends[0] = min(first + last, max(0, model.weight_bytes - n * layer))
        weights = [-(-k * layer // tp) + end for k, end in zip(layers, ends, strict=True)]
    kv_share = model.num_kv_heads // tp
    kv_blocks = [-(-block_bytes * kv_share * k // (model.num_kv_heads * n)) for k in layers]
    return tuple(Stage(k, w, b) for k, w, b in zip(layers, weights, kv_blocks, strict=True))


LOGIT_BYTES = 4  # the last stage returns FP32 logits of the sampled rows (parallel/pipeline.py)


def boundary_bytes_per_step(model: ModelFacts, parts: ModelParts | None, num_seqs: int) -> int | None:
    """Hidden states one decode step of ``num_seqs`` sequences sends across each stage boundary
    ([num_seqs, hidden_size] in the activation dtype); None where the hidden size is unknown."""
    if parts is None:
        return None
    return num_seqs * parts.hidden_size * DTYPE_BYTES[model.dtype]

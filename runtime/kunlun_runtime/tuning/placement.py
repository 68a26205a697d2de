"""Where the model goes: tensor-parallel size T, pipeline-parallel size P, KV cache per card.

Rule: one node (P = 1) with the smallest valid T at which a card holds its weights, the measured
activations and the KV of one ``max_model_len`` sequence within ``memory_fraction`` of its memory;
where even the largest valid T within a node's cards does not, that T and the smallest P (nodes,
at most ``max_nodes`` and the layer count) at which the fullest card of any stage does. The per-card
arithmetic is ``stages.plan_stages``; every choice comes with a reason quoting its numbers.

Pure: no torch, no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kunlun_runtime.tuning.measurements import Measurements, ModelFacts, ModelParts
from kunlun_runtime.tuning.stages import (
    DTYPE_BYTES,
    LOGIT_BYTES,
    Stage,
    boundary_bytes_per_step,
    plan_stages,
    valid_tp_sizes,
)
from kunlun_runtime.tuning.targets import MIB, Targets, TuningError, ms, size


@dataclass(frozen=True, slots=True)
class Placement:
    """Where the model goes: T cards per node, P nodes, and the KV cache of each card."""

    tp: int
    pp: int
    kv_cache_bytes: int  # per card, on the stage with the most layers (all stages hold as many blocks)
    reasons: dict[str, str]  # kv_cache_memory_bytes, tensor_parallel_size, pipeline_parallel_size where P > 1


@dataclass(frozen=True, slots=True)
class _Fit:
    """The fullest card of one (T, P) layout: what it must hold against the budget."""

    tp: int
    stages: tuple[Stage, ...]
    fullest: int  # index of the stage whose card needs the most
    weights: int
    one_seq: int  # KV of one max_model_len sequence on that card
    need: int  # weights + activations + one_seq

    @classmethod
    def of(cls, tp: int, stages: tuple[Stage, ...], activation: int, blocks_per_seq: int) -> _Fit:
        needs = [s.weight_bytes + activation + blocks_per_seq * s.kv_block_bytes for s in stages]
        i = max(range(len(stages)), key=lambda j: (needs[j], j))
        one_seq = blocks_per_seq * stages[i].kv_block_bytes
        return cls(tp, stages, i, stages[i].weight_bytes, one_seq, needs[i])


@dataclass(frozen=True, slots=True)
class _Scope:
    """What every reason quotes: the model, the card budget and the node's cards."""

    model: ModelFacts
    parts: ModelParts | None
    activation: int
    budget: int
    of_memory: str  # "90% of 96.00 GiB"
    memory: str  # "90% of 96.00 GiB (device memory per card)"
    where: str  # "8 card(s) here" or "8 card(s) per node"
    valid: list[int]  # the TP sizes that divide the model within a node

    def card(self, fit: _Fit) -> str:
        return (
            f"weights {size(fit.weights)} + activations {size(self.activation)} + one "
            f"{self.model.max_model_len}-token sequence of KV ({size(fit.one_seq)}) = {size(fit.need)}"
        )


def choose_placement(
    m: Measurements, num_seqs: int, block_size: int, block_bytes: int, activation_bytes: int, targets: Targets
) -> Placement:
    """T, P and the KV cache per card, each with its reason.

    ``block_bytes``: one KV block of all layers on one card at TP 1, padding included.

    Raises:
        TuningError: no TP size divides the model, or it fits no card even over ``max_nodes`` nodes.
    """
    model, platform = m.model, m.platform
    cards = targets.cards_per_node or platform.num_cards
    where = f"{cards} card(s) {'here' if targets.cards_per_node is None else 'per node'}"
    valid = valid_tp_sizes(model, m.parts, targets.tp_sizes, cards)
    if not valid:
        counts = f"{model.num_heads} heads, {model.num_kv_heads} KV heads"
        if m.parts is not None:
            counts += f" and intermediate size {m.parts.intermediate_size}"
        raise TuningError(
            f"no TP size of {list(targets.tp_sizes)} within {where} divides the model's {counts}"
        )
    of_memory = f"{targets.memory_fraction:.0%} of {size(platform.memory_bytes_per_card)}"
    budget = int(targets.memory_fraction * platform.memory_bytes_per_card)
    memory = f"{of_memory} ({platform.memory_source})"
    scope = _Scope(model, m.parts, activation_bytes, budget, of_memory, memory, where, valid)
    blocks_per_seq = -(-model.max_model_len // block_size)

    def fit(tp: int, pp: int) -> _Fit:
        return _Fit.of(tp, plan_stages(model, m.parts, block_bytes, tp, pp), activation_bytes, blocks_per_seq)

    one_node, chosen, max_pp = _search(scope, fit, targets, cards)
    tp, pp = chosen.tp, len(chosen.stages)
    kv, kv_reason = _kv_cache(scope, chosen, num_seqs, block_size)
    reasons = {
        "kv_cache_memory_bytes": kv_reason,
        "tensor_parallel_size": _tp_reason(scope, one_node, tp, pp),
    }
    if pp > 1:  # one node: the option is left at the engine's default, and the TP reason says why
        reasons["pipeline_parallel_size"] = _pp_reason(scope, chosen, one_node, max_pp, num_seqs, targets)
    return Placement(tp, pp, kv, reasons)


def _search(
    scope: _Scope, fit: Callable[[int, int], _Fit], targets: Targets, cards: int
) -> tuple[_Fit, _Fit, int]:
    """(the chosen TP size on one node, the chosen layout, the most nodes allowed): the smallest
    valid TP size that fits one node, else the largest and the fewest nodes that fit.

    Raises:
        TuningError: not even ``max_nodes`` nodes (or one per layer) fit, with the numbers.
    """
    model, budget, valid = scope.model, scope.budget, scope.valid
    single = {tp: fit(tp, 1) for tp in valid}
    tp = next((tp for tp in valid if single[tp].need <= budget), valid[-1])
    chosen, max_pp = single[tp], min(targets.max_nodes, model.num_layers)
    if chosen.need > budget and max_pp < 2:
        raise TuningError(
            f"the model does not fit: weights {size(model.weight_bytes)} + "
            f"activations {size(scope.activation)} + one {model.max_model_len}-token sequence of KV "
            f"exceed {scope.of_memory} per card at every TP size in {valid} "
            f"({cards} card(s)); lower max_model_len or use more cards"
        )
    while chosen.need > budget and len(chosen.stages) < max_pp:
        chosen = fit(tp, len(chosen.stages) + 1)
    if chosen.need > budget:
        raise TuningError(
            f"the model does not fit: at TP {tp} (the largest of {valid}, {scope.where}) over "
            f"{len(chosen.stages)} nodes (at most --max-nodes {targets.max_nodes} and one per layer) the fullest "
            f"card needs {scope.card(chosen)}, over {scope.of_memory} ({size(budget)}); weights "
            f"{size(model.weight_bytes)} in all; lower max_model_len, use cards with more memory or allow "
            "more nodes"
        )
    return single[tp], chosen, max_pp


def _tp_reason(scope: _Scope, one_node: _Fit, tp: int, pp: int) -> str:
    if pp == 1:
        return (
            f"smallest TP size (of {scope.valid}) at which a card holds its weights ({size(one_node.weights)}), "
            f"activations ({size(scope.activation)}) and one {scope.model.max_model_len}-token sequence of KV "
            f"({size(one_node.one_seq)}) within {scope.memory}; {scope.where}"
        )
    return (
        f"the largest TP size (of {scope.valid}) within {scope.where}: even at TP {tp} a card of one node "
        f"would need {scope.card(one_node)}, over {scope.memory}; so the layers are split over nodes"
    )


def _pp_reason(
    scope: _Scope, chosen: _Fit, one_node: _Fit, max_pp: int, num_seqs: int, targets: Targets
) -> str:
    pp, tp = len(chosen.stages), chosen.tp
    layers = [s.num_layers for s in chosen.stages]
    reason = (
        f"smallest number of nodes (of up to {max_pp}) at which every card fits: {pp} nodes × {tp} cards = "
        f"{pp * tp} cards, layers per stage {layers} (embedding on the first, norm and lm_head on the last); "
        f"the fullest card (stage {chosen.fullest}) holds {scope.card(chosen)} of its {size(scope.budget)} "
        f"budget, against {size(one_node.need)} on one node"
    )
    moved = boundary_bytes_per_step(scope.model, scope.parts, num_seqs)
    if moved is None or scope.parts is None:
        return reason + "; hidden_size not recorded: the bytes crossing a stage boundary are not computed"
    boundaries = "the stage boundary" if pp == 2 else f"each of the {pp - 1} stage boundaries"
    reason += (
        f"; {boundaries} moves max_num_seqs={num_seqs} × hidden_size={scope.parts.hidden_size} × "
        f"{DTYPE_BYTES[scope.model.dtype]} B = {size(moved)} of hidden states per decode step"
    )
    if targets.stage_boundary_seconds is None:
        reason += " (its time not given: --stage-boundary-ms)"
    else:
        total = (pp - 1) * targets.stage_boundary_seconds
        reason += f", {ms(targets.stage_boundary_seconds)} each: {ms(total)} per decode step in all"
    logits = num_seqs * scope.parts.vocab_size * LOGIT_BYTES
    return reason + (
        f"; and the last stage returns max_num_seqs={num_seqs} × vocab_size={scope.parts.vocab_size} × "
        f"{LOGIT_BYTES} B = {size(logits)} of FP32 logits to the leader per decode step"
    )


def _kv_cache(scope: _Scope, chosen: _Fit, num_seqs: int, block_size: int) -> tuple[int, str]:
    """KV bytes per card, sized on the stage with the most layers: every stage keeps as many blocks
    (one block table for the whole pipeline), so the tightest stage sets the count."""
    widest = max(chosen.stages, key=lambda s: s.kv_block_bytes)
    card_block = widest.kv_block_bytes
    free = [scope.budget - s.weight_bytes - scope.activation for s in chosen.stages]
    room = min(f * card_block // s.kv_block_bytes for f, s in zip(free, chosen.stages, strict=True))
    one_seq = -(-scope.model.max_model_len // block_size) * card_block
    useful = num_seqs * one_seq
    kv = min(room, useful)
    kv = max(one_seq, kv // MIB * MIB) if kv >= MIB else kv
    reason = (
        f"min(room left on a card: {size(room)}, KV of max_num_seqs={num_seqs} sequences of "
        f"max_model_len={scope.model.max_model_len}: {size(useful)}); holds {kv // card_block * block_size} "
        f"tokens ({kv / one_seq:.1f} full-length sequences) at {card_block / block_size:g} B/token per card"
    )
    if len(chosen.stages) > 1:
        reason += (
            f" (the stage with the most layers, {widest.num_layers} of {scope.model.num_layers}; every stage "
            "holds as many blocks)"
        )
    return kv, reason

"""A model's LoRA slots: give every projection its slots, and install an adapter into one.

Each rank installs the same full-size adapter (``lora.checkpoint``) and keeps its own share: the
layers of its pipeline stage (renumbered as the stage numbers them) and, under tensor
parallelism, the rows of B of the column-parallel projections (q/k/v, gate/up) and the columns
of A of the row-parallel ones (o, down), cut exactly as the base weights are
(``models.sharding``). A row-parallel projection's update is then a partial sum that the layer's
all-reduce completes with the base output (the update is linear in the input).
"""

from __future__ import annotations

import torch

from kunlun_runtime.layers.lora import LoRAProjection
from kunlun_runtime.lora.checkpoint import NUM_PIECES, LoRAAdapter
from kunlun_runtime.models.decoder import MLP, Attention, DecoderLayer, DecoderModel
from kunlun_runtime.models.model_config import ModelConfig
from kunlun_runtime.models.sharding import shard_weight


def _projections(layer: DecoderLayer) -> list[tuple[str, Attention | MLP, str]]:
    """(fused name as the checkpoint numbers it, without the layer; owner module; projection)."""
    attn, mlp = layer.self_attn, layer.mlp
    return [
        ("self_attn.qkv_proj", attn, "qkv_proj"),
        ("self_attn.o_proj", attn, "o_proj"),
        ("mlp.gate_up_proj", mlp, "gate_up_proj"),
        ("mlp.down_proj", mlp, "down_proj"),
    ]


def enable_lora_slots(model: DecoderModel, max_loras: int, max_rank: int) -> int:
    """Give every projection of ``model`` ``max_loras`` empty slots; returns their bytes."""
    dtype = model.activation_dtype
    device = model.weight_matrix.device
    total = 0
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)  # built so
        for fused, owner, attr in _projections(layer):
            linear = getattr(owner, attr)
            projection = LoRAProjection(
                max_loras, NUM_PIECES[fused], max_rank, linear.in_features, linear.out_features, dtype, device
            )
            projection.native = model.native_kernels
            owner.lora[attr] = projection
            total += projection.nbytes
    if model.decode_weights is not None:  # the one-call decode step applies them too
        model.decode_lora = [
            tensor
            for layer in model.layers
            for _, owner, attr in _projections(layer)  # type: ignore[arg-type]
            for tensor in owner.lora[attr].tensors
        ]
    return total


def install_adapter(
    model: DecoderModel,
    slot: int,
    adapter: LoRAAdapter | None,
    tp_rank: int = 0,
    tp_world: int = 1,
) -> None:
    """Put this rank's share of ``adapter`` in ``slot`` of every projection (None: empty it)."""
    for index, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)  # built so
        for fused, owner, attr in _projections(layer):
            pair = (
                None
                if adapter is None
                else adapter.weights.get(f"layers.{model.first_layer + index}.{fused}")
            )
            if pair is None:
                owner.lora[attr].install(slot, None, None)
                continue
            a, b = pair
            if tp_world > 1:
                assert adapter is not None  # pair came from it
                a, b = _shard(fused, a, b, adapter.base, tp_rank, tp_world)
            owner.lora[attr].install(slot, a, b)


def _shard(
    fused: str, a: torch.Tensor, b: torch.Tensor, config: ModelConfig, rank: int, world: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's A [parts, r, in'] and B [out', parts, r], cut as the base weight ``fused``."""
    parts, r, width = a.shape
    name = f"{fused}.weight"
    if fused in ("self_attn.o_proj", "mlp.down_proj"):  # row parallel: A's input columns
        return shard_weight(name, a.reshape(parts * r, width), config, rank, world).reshape(parts, r, -1), b
    out = b.shape[0]  # column parallel: B's output rows
    return a, shard_weight(name, b.reshape(out, parts * r), config, rank, world).reshape(-1, parts, r)

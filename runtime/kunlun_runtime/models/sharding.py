"""How a model is split over ``world`` tensor-parallel ranks (pure functions, no torch.distributed).

Attention is split by heads (query heads and KV heads each into ``world`` contiguous groups, so
every query head stays with its KV head under GQA), the MLP by intermediate columns. Column
parallel: the fused ``qkv_proj`` and ``gate_up_proj`` (rows of the weight); row parallel:
``o_proj`` and ``down_proj`` (columns), whose partial outputs are summed by an all-reduce.
Embedding, norms and ``lm_head`` are replicated.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kunlun_runtime.errors import ConfigError
from kunlun_runtime.models.model_config import ModelConfig


def validate_tensor_parallel(config: ModelConfig, world: int) -> None:
    """Raise ConfigError naming tensor_parallel_size when the model cannot be split ``world`` ways."""
    for what, count in (
        ("num_attention_heads", config.num_heads),
        ("num_key_value_heads", config.num_kv_heads),
        ("intermediate_size", config.intermediate_size),
    ):
        if count % world:
            raise ConfigError(
                f"tensor_parallel_size: {world} does not divide the model's {what} ({count})",
                field="tensor_parallel_size",
            )


def shard_model_config(config: ModelConfig, world: int) -> ModelConfig:
    """The per-rank shapes: 1/world of the heads, KV heads and intermediate size."""
    validate_tensor_parallel(config, world)
    return replace(
        config,
        num_heads=config.num_heads // world,
        num_kv_heads=config.num_kv_heads // world,
        intermediate_size=config.intermediate_size // world,
    )


def _rows(tensor: torch.Tensor, start: int, size: int) -> torch.Tensor:
    return tensor.narrow(0, start, size)


def shard_weight(name: str, tensor: torch.Tensor, config: ModelConfig, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s part of the (fused, full-size) weight ``name``."""
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
        q_part, kv_part = q // world, kv // world
        return torch.cat(
            [
                _rows(tensor, rank * q_part, q_part),
                _rows(tensor, q + rank * kv_part, kv_part),
                _rows(tensor, q + kv + rank * kv_part, kv_part),
            ]
        )
    if name.endswith("gate_up_proj.weight"):
        part = inter // world
        return torch.cat([_rows(tensor, rank * part, part), _rows(tensor, inter + rank * part, part)])
    if name.endswith("o_proj.weight"):
        part = q // world
        return tensor.narrow(1, rank * part, part)
    if name.endswith("down_proj.weight"):
        part = inter // world
        return tensor.narrow(1, rank * part, part)
    return tensor

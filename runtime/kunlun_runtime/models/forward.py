"""One forward pass over a step's flat batch, as every tensor-parallel rank runs it.

``StepInputs`` is what a rank needs for a step, as plain lists so that rank 0 can send it to the
workers cheaply; ``run_forward`` turns it into attention metadata and calls the model. It knows
nothing about requests or scheduling: the engine's model runner builds the inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kunlun_runtime.kv.cache import KVCache
from kunlun_runtime.layers.attention import build_attention_metadata
from kunlun_runtime.layers.lora import LoRABatch
from kunlun_runtime.models.decoder import DecoderModel


@dataclass(slots=True)
class StepInputs:
    """Everything a rank needs to run one step (plain lists: cheap to send to workers)."""

    token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    # Each sequence's LoRA slot (layers.lora.BASE_SLOT: the base model); empty: no adapter at all.
    lora_slots: list[int] = field(default_factory=list)


@torch.inference_mode()
def run_forward(
    model: DecoderModel,
    kv_cache: KVCache,
    inputs: StepInputs,
    device: torch.device,
    hidden: torch.Tensor | None = None,
) -> torch.Tensor:
    """One forward pass over a step's flat batch; returns final hidden states [T, hidden] (a
    pipeline stage before the last: its output stream; a stage after the first starts from
    ``hidden``, the previous stage's)."""
    meta = build_attention_metadata(
        inputs.query_lens,
        inputs.context_lens,
        inputs.block_tables,
        kv_cache.spec.block_size,
        device,
        sliding_window=model.config.sliding_window,
    )
    return model(
        torch.tensor(inputs.token_ids, dtype=torch.long, device=device),
        torch.tensor(inputs.positions, dtype=torch.long, device=device),
        kv_cache,
        meta,
        hidden,
        LoRABatch.build(inputs.lora_slots, inputs.query_lens, device),
    )

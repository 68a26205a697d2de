"""Runs one scheduled step through the model: builds the flat batch, calls forward, returns logits.

Owns the model and the KV cache tensors. Input building is vectorised (block tables, positions
and slot mapping come from a handful of tensor ops per step, not per-token Python). Under tensor
parallelism, rank 0 (this runner) sends each step's ``StepInputs`` to the worker ranks, which run
the same forward in lockstep; the all-reduces inside the model keep them together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kunlun_runtime.engine.scheduler_output import SchedulerOutput
from kunlun_runtime.kv.cache import KVCache
from kunlun_runtime.models.decoder import DecoderModel
from kunlun_runtime.models.forward import StepInputs, run_forward


@dataclass(slots=True)
class StepLogits:
    sample_logits: torch.Tensor  # [S, V] FP32: one row per request that gets a new token
    sample_request_ids: list[str]
    prompt_logits: dict[
        str, tuple[int, torch.Tensor]
    ]  # request id → (first position, [n, V]) for prompt logprobs


class StepBroadcaster(Protocol):
    """Sends a step's inputs to the other tensor-parallel ranks (see parallel/workers.py)."""

    def broadcast(self, inputs: StepInputs) -> None: ...


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        kv_cache: KVCache,
        device: torch.device,
        broadcaster: StepBroadcaster | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.broadcaster = broadcaster

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, block_tables: dict[str, list[int]]) -> StepLogits:
        inputs = StepInputs()
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        prompt_rows: dict[str, tuple[int, int, int]] = {}  # id → (first row, count, first position)
        for item in out.scheduled:
            request, start, count = item.request, item.request.num_computed_tokens, item.num_new_tokens
            row0 = len(inputs.token_ids)
            inputs.token_ids.extend(request.all_token_ids[start : start + count])
            inputs.positions.extend(range(start, start + count))
            inputs.query_lens.append(count)
            inputs.context_lens.append(start + count)
            inputs.block_tables.append(block_tables[request.request_id])
            if request.wants_prompt_logprobs and start < len(request.prompt_token_ids) - 1:
                num_prompt_rows = min(count, len(request.prompt_token_ids) - 1 - start)
                prompt_rows[request.request_id] = (row0, num_prompt_rows, start)
            if start + count == request.num_tokens:
                sample_rows.append(row0 + count - 1)
                sample_ids.append(request.request_id)
        if self.broadcaster is not None:
            self.broadcaster.broadcast(inputs)
        hidden = run_forward(self.model, self.kv_cache, inputs, self.device)
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        sample_logits = self.model.compute_logits(hidden.index_select(0, rows))
        prompt_logits = {
            request_id: (first_pos, self.model.compute_logits(hidden[row0 : row0 + count]))
            for request_id, (row0, count, first_pos) in prompt_rows.items()
        }
        return StepLogits(sample_logits, sample_ids, prompt_logits)

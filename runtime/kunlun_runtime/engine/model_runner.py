"""Runs one scheduled step through the model: builds the flat batch, calls forward, returns logits.

Owns the model and the KV cache tensors. Input building is vectorised (block tables, positions
and slot mapping come from a handful of tensor ops per step, not per-token Python). With more
than one rank, rank 0 (this runner) hands each step to the group (``parallel/``): under tensor
parallelism every rank runs the same forward in lockstep, the all-reduces inside the model keeping
them together; under pipeline parallelism the step's sequences are split into micro-batches that
flow through the stages, and the last stage returns the logits of the rows asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kunlun_runtime.engine.scheduler_output import SchedulerOutput
from kunlun_runtime.kv.cache import KVCache
from kunlun_runtime.layers.lora import BASE_SLOT
from kunlun_runtime.models.decoder import DecoderModel
from kunlun_runtime.models.forward import StepInputs, run_forward
from kunlun_runtime.parallel.layout import ParallelLayout
from kunlun_runtime.parallel.pipeline import StepPlan, plan_step


@dataclass(slots=True)
class StepLogits:
    sample_logits: torch.Tensor  # [S, V] FP32: a row per request that gets a new token, and per draft
    sample_request_ids: list[str]
    sample_counts: list[int]  # rows of each of sample_request_ids: 1 + its drafts
    prompt_logits: dict[
        str, tuple[int, torch.Tensor]
    ]  # request id → (first position, [n, V]) for prompt logprobs


class RankGroup(Protocol):
    """Runs a step on every rank and returns the wanted logits (``parallel.workers.LeaderGroup``)."""

    layout: ParallelLayout

    def execute(self, plan: StepPlan) -> list[torch.Tensor]: ...


class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        kv_cache: KVCache,
        device: torch.device,
        group: RankGroup | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.group = group
        # Micro-batches per step: one per stage keeps every stage busy (1: no overlap, the
        # baseline the pipeline benchmark compares with).
        self.micro_batches = group.layout.pipeline if group is not None else 1

    @torch.inference_mode()
    def execute(
        self,
        out: SchedulerOutput,
        block_tables: dict[str, list[int]],
        lora_slots: dict[str, int] | None = None,
    ) -> StepLogits:
        """``lora_slots``: the LoRA slot of each request on an adapter (None or empty: none is)."""
        inputs = StepInputs()
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        sample_counts: list[int] = []
        prompt_rows: dict[str, tuple[int, int, int]] = {}  # id → (first row, count, first position)
        for item in out.scheduled:
            request, start, count = item.request, item.request.num_computed_tokens, item.num_new_tokens
            row0 = len(inputs.token_ids)
            drafts = request.spec_token_ids[: item.num_draft_tokens]
            real = count - len(drafts)
            inputs.token_ids.extend(request.all_token_ids[start : start + real])
            inputs.token_ids.extend(drafts)
            inputs.positions.extend(range(start, start + count))
            # A decode with drafts runs as one one-token sequence per position over the same block
            # table, each attending up to itself: the step stays a decode step (every K/V is written
            # before any row attends), with its one-call kernels, where one sequence of 1 + k
            # query tokens would take the prefill path over the whole context.
            sequences = count if drafts else 1
            table = block_tables[request.request_id]
            for index in range(sequences):
                length = count if sequences == 1 else 1
                inputs.query_lens.append(length)
                inputs.context_lens.append(start + index + length)
                inputs.block_tables.append(table)
                if lora_slots:
                    inputs.lora_slots.append(lora_slots.get(request.request_id, BASE_SLOT))
            if request.wants_prompt_logprobs and start < len(request.prompt_token_ids) - 1:
                num_prompt_rows = min(count, len(request.prompt_token_ids) - 1 - start)
                prompt_rows[request.request_id] = (row0, num_prompt_rows, start)
            if start + real == request.num_tokens:  # its last token, and each draft after it
                sample_rows.extend(range(row0 + real - 1, row0 + count))
                sample_ids.append(request.request_id)
                sample_counts.append(1 + len(drafts))
        wanted = sample_rows + [
            row for row0, count, _ in prompt_rows.values() for row in range(row0, row0 + count)
        ]
        logits = self._logits(inputs, wanted)
        sample_logits = logits[: len(sample_rows)]
        prompt_logits: dict[str, tuple[int, torch.Tensor]] = {}
        offset = len(sample_rows)
        for request_id, (_, count, first_pos) in prompt_rows.items():
            prompt_logits[request_id] = (first_pos, logits[offset : offset + count])
            offset += count
        return StepLogits(sample_logits, sample_ids, sample_counts, prompt_logits)

    def _logits(self, inputs: StepInputs, rows: list[int]) -> torch.Tensor:
        """FP32 logits [len(rows), V] of the step's ``rows``, in that order."""
        if self.group is None:
            hidden = run_forward(self.model, self.kv_cache, inputs, self.device)
            index = torch.tensor(rows, dtype=torch.long, device=self.device)
            return self.model.compute_logits(hidden.index_select(0, index))
        plan, order = plan_step(inputs, rows, self.micro_batches)
        parts = self.group.execute(plan)
        logits = parts[0] if len(parts) == 1 else torch.cat(parts)  # a plan has a micro-batch or more
        if order != list(range(len(order))):
            logits = logits.index_select(0, torch.tensor(order, dtype=torch.long, device=logits.device))
        return logits

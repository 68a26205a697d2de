"""One step through the pipeline stages, as every rank runs it.

The leader splits a step's sequences into micro-batches (``plan_step``) and sends the plan to
every rank. Each stage runs the micro-batches in order: it receives a micro-batch's hidden states
from the previous stage (the first stage embeds the tokens), runs its layers, and hands the result
on without waiting for it to be taken (``isend``), so that while stage 1 works on micro-batch 0,
stage 0 already works on micro-batch 1: with P stages and M micro-batches a step takes about
(M + P - 1)/M stage-times instead of P. Splitting costs where a micro-batch is small: every
micro-batch reads the stage's weights again, so a step is split only into micro-batches of at
least ``MIN_MICRO_BATCH_TOKENS`` tokens. The last stage's tensor rank 0 computes the logits of
the rows the leader asked for and sends them back to the leader, which samples; they travel in
the dtype ``lm_head`` computed them in (BF16 on hardware that computes in BF16: the precision
they have anyway, at half the bytes of FP32) and are widened on arrival. Under tensor
parallelism every rank of a stage holds the full hidden states (after the layers' all-reduces),
so each sends to its own peer in the next stage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from kunlun_runtime.kv.cache import KVCache
from kunlun_runtime.models.decoder import DecoderModel
from kunlun_runtime.models.forward import StepInputs, run_forward
from kunlun_runtime.parallel.layout import ParallelLayout, split_layers

# A decode micro-batch of a few sequences costs about as much as one of many (the stage's weights
# are read either way): below this many tokens per micro-batch the overlap does not pay
# (docs/performance.md has the measurement).
MIN_MICRO_BATCH_TOKENS = 4


@dataclass(slots=True)
class StepPlan:
    """A step as every rank runs it (plain lists: cheap to send)."""

    micro_batches: list[StepInputs]
    logit_rows: list[list[int]]  # per micro-batch, its rows whose logits the leader wants


def plan_step(inputs: StepInputs, rows: list[int], count: int) -> tuple[StepPlan, list[int]]:
    """Split the step's sequences into at most ``count`` micro-batches of consecutive sequences,
    balanced by tokens, each of at least ``MIN_MICRO_BATCH_TOKENS`` tokens where there is more
    than one. ``rows`` are the step's rows (over all its tokens) whose logits are wanted, in the
    order wanted. Returns the plan and, for each of ``rows``, its index among the micro-batches'
    logits concatenated in order."""
    lengths = inputs.query_lens
    count = min(count, len(lengths), len(inputs.token_ids) // MIN_MICRO_BATCH_TOKENS)
    groups = [range(len(lengths))]
    while count > 1:  # fewer, larger micro-batches where a split leaves one too small
        groups = split_layers(lengths, count)
        if min(sum(lengths[g.start : g.stop]) for g in groups) >= MIN_MICRO_BATCH_TOKENS:
            break
        count -= 1
    if len(groups) == 1 or count <= 1:
        return StepPlan([inputs], [list(rows)]), list(range(len(rows)))
    micro_batches: list[StepInputs] = []
    row_bounds: list[tuple[int, int]] = []
    row = 0
    for group in groups:
        tokens = sum(lengths[group.start : group.stop])
        micro_batches.append(
            StepInputs(
                token_ids=inputs.token_ids[row : row + tokens],
                positions=inputs.positions[row : row + tokens],
                query_lens=inputs.query_lens[group.start : group.stop],
                context_lens=inputs.context_lens[group.start : group.stop],
                block_tables=inputs.block_tables[group.start : group.stop],
                lora_slots=inputs.lora_slots[group.start : group.stop],
            )
        )
        row_bounds.append((row, row + tokens))
        row += tokens
    logit_rows: list[list[int]] = [[] for _ in groups]
    where: list[tuple[int, int]] = []  # per wanted row: (micro-batch, index within its rows)
    for wanted in rows:
        index = next(i for i, (start, stop) in enumerate(row_bounds) if start <= wanted < stop)
        where.append((index, len(logit_rows[index])))
        logit_rows[index].append(wanted - row_bounds[index][0])
    offsets = [0]
    for batch_rows in logit_rows:
        offsets.append(offsets[-1] + len(batch_rows))
    return StepPlan(micro_batches, logit_rows), [offsets[index] + i for index, i in where]


class StageRunner:
    """One rank's part of every step: its stage's layers over each micro-batch, with the sends and
    receives at the stage boundaries."""

    def __init__(
        self,
        model: DecoderModel,
        kv_cache: KVCache,
        device: torch.device,
        layout: ParallelLayout,
        rank: int,
        group: ProcessGroup | None = None,
        logits_group: ProcessGroup | None = None,
    ) -> None:
        """``group``: the hidden states' (all ranks); ``logits_group``: the leader and the last
        stage's first rank, for the logits coming back."""
        self.model, self.kv_cache, self.device = model, kv_cache, device
        self.layout, self.rank, self.group, self.logits_group = layout, rank, group, logits_group
        self.stage = layout.stage_of(rank)
        self.is_first = self.stage == 0
        self.is_last = self.stage == layout.pipeline - 1
        self.returns_logits = self.is_last and layout.tensor_rank_of(rank) == 0

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> list[torch.Tensor]:
        """Run the plan's micro-batches through this stage. Returns the logits per micro-batch
        where this rank is the leader and the last stage at once (one stage), else []: the
        leader then takes them with ``receive_logits``."""
        pending: list[tuple[dist.Work, torch.Tensor]] = []  # sends in flight, with their buffers
        logits: list[torch.Tensor] = []
        for index, inputs in enumerate(plan.micro_batches):
            hidden = None
            if not self.is_first:
                hidden = torch.empty(
                    len(inputs.token_ids),
                    self.model.config.hidden_size,
                    dtype=self.model.activation_dtype,
                    device=self.device,
                )
                dist.recv(hidden, src=self.layout.previous_rank(self.rank), group=self.group, tag=index)
            out = run_forward(self.model, self.kv_cache, inputs, self.device, hidden)
            if not self.is_last:
                out = out.contiguous()
                work = dist.isend(out, dst=self.layout.next_rank(self.rank), group=self.group, tag=index)
                assert work is not None  # this rank is in the group
                pending.append((work, out))
                continue
            if not self.returns_logits:
                continue
            rows = torch.tensor(plan.logit_rows[index], dtype=torch.long, device=self.device)
            if self.rank == 0:
                logits.append(self.model.compute_logits(out.index_select(0, rows)))
                continue
            narrow = self.model.compute_logits(out.index_select(0, rows), widen=False)
            batch_logits = narrow.to(self.model.activation_dtype).contiguous()  # what the leader expects
            if rows.numel():
                work = dist.isend(batch_logits, dst=0, group=self.logits_group, tag=index)
                assert work is not None
                pending.append((work, batch_logits))
        for work, _ in pending:
            work.wait()
        return logits


def receive_logits(
    plan: StepPlan,
    vocab_size: int,
    source: int,
    group: ProcessGroup | None,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """The leader's side of the return path: each micro-batch's logits from rank ``source``, sent
    in ``dtype`` (the last stage's ``lm_head`` output dtype), widened to FP32."""
    received = []
    for index, rows in enumerate(plan.logit_rows):
        logits = torch.empty(len(rows), vocab_size, dtype=dtype, device=device)
        if rows:
            dist.recv(logits, src=source, group=group, tag=index)
        received.append(logits.float())
    return received

"""Where every rank sits (pure functions, no torch.distributed).

``world = tensor × pipeline`` ranks. Rank ``r`` runs pipeline stage ``r // tensor`` as tensor
rank ``r % tensor``: the ranks of a stage are consecutive, so with ``nnodes`` nodes of
``world / nnodes`` ranks each, tensor parallelism (an all-reduce in every layer) stays inside a
node and only the stage boundaries (one send of the hidden states per micro-batch) cross nodes.
Node ``k`` runs ranks ``k·L … k·L+L-1`` (``L`` ranks per node) and binds rank ``r`` to its local
device ``r - k·L``. Rank 0, on node 0, is the leader: it schedules, samples and serves.

Layers are split into contiguous stages balanced by parameter bytes, the embedding counted with
the first stage and the final norm and ``lm_head`` with the last.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kunlun_runtime.errors import ConfigError
from kunlun_runtime.models.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    tensor: int = 1  # T: ranks per stage (cards one stage is split over, inside a node)
    pipeline: int = 1  # P: stages
    nnodes: int = 1
    node_rank: int = 0  # this process's node

    def validate(self) -> ParallelLayout:
        """Raise ConfigError naming the option when the ranks cannot be laid out so."""
        for name, value in (
            ("tensor_parallel_size", self.tensor),
            ("pipeline_parallel_size", self.pipeline),
            ("nnodes", self.nnodes),
        ):
            if value < 1:
                raise ConfigError(f"{name}: must be >= 1, got {value}", field=name)
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(
                f"node_rank: must be in [0, {self.nnodes}) for {self.nnodes} nodes, got {self.node_rank}",
                field="node_rank",
            )
        if self.world % self.nnodes:
            raise ConfigError(
                f"nnodes: {self.nnodes} nodes cannot share {self.world} ranks "
                f"(tensor_parallel_size {self.tensor} × pipeline_parallel_size {self.pipeline}) evenly",
                field="nnodes",
            )
        if self.ranks_per_node % self.tensor:
            raise ConfigError(
                f"nnodes: {self.ranks_per_node} ranks per node would split a stage's "
                f"{self.tensor} tensor-parallel ranks across nodes; use at most {self.pipeline} nodes "
                "(tensor parallelism stays inside a node)",
                field="nnodes",
            )
        return self

    @property
    def world(self) -> int:
        return self.tensor * self.pipeline

    @property
    def ranks_per_node(self) -> int:
        return self.world // self.nnodes

    @property
    def node_ranks(self) -> range:
        """The global ranks this node runs (its first is the process the node was started as)."""
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)

    def stage_of(self, rank: int) -> int:
        return rank // self.tensor

    def tensor_rank_of(self, rank: int) -> int:
        return rank % self.tensor

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_rank_of(self, rank: int) -> int:
        """The device index rank ``rank`` binds on its node."""
        return rank % self.ranks_per_node

    def stage_ranks(self, stage: int) -> range:
        return range(stage * self.tensor, (stage + 1) * self.tensor)

    def next_rank(self, rank: int) -> int:
        """The peer in the next stage that rank ``rank`` sends its hidden states to."""
        return rank + self.tensor

    def previous_rank(self, rank: int) -> int:
        return rank - self.tensor

    @property
    def last_stage_leader(self) -> int:
        """The rank that returns the logits to the leader (tensor rank 0 of the last stage)."""
        return (self.pipeline - 1) * self.tensor


def layer_bytes(config: ModelConfig, bytes_per_weight: int = 2) -> tuple[int, int, int]:
    """(one decoder layer, the embedding, the final norm with ``lm_head``) in bytes of weights
    (the same for every layer of the Llama family; ``lm_head`` counted even where it is tied, as
    the last stage holds its own copy)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    attention = hidden * (config.q_size + 2 * config.kv_size) + config.q_size * hidden
    layer = attention + 3 * hidden * inter + 2 * hidden
    embedding = config.vocab_size * hidden
    return layer * bytes_per_weight, embedding * bytes_per_weight, (embedding + hidden) * bytes_per_weight


def split_layers(
    layer_sizes: Sequence[int], stages: int, first_extra: int = 0, last_extra: int = 0
) -> list[range]:
    """Contiguous ranges of the layers, one per stage, every stage at least one layer, that make
    the largest stage (its layers' bytes, plus ``first_extra`` on the first and ``last_extra`` on
    the last) as small as possible. Where several splits do, later stages take the most layers:
    the first stage's rank 0 also schedules and samples. Raises ConfigError naming
    pipeline_parallel_size when there are fewer layers than stages."""
    count = len(layer_sizes)
    if stages < 1 or stages > count:
        raise ConfigError(
            f"pipeline_parallel_size: {stages} stages need at least that many layers; the model has {count}",
            field="pipeline_parallel_size",
        )

    def cut(capacity: int) -> list[range] | None:
        """Greedy from the last stage backwards (it carries ``last_extra``): each stage takes as
        many layers as fit, leaving at least one per earlier stage."""
        bounds: list[range] = []
        stop = count
        for stage in reversed(range(stages)):
            extra = (first_extra if stage == 0 else 0) + (last_extra if stage == stages - 1 else 0)
            start = stop - 1
            if extra + layer_sizes[start] > capacity:
                return None
            total = extra + layer_sizes[start]
            while start > stage and total + layer_sizes[start - 1] <= capacity:
                start -= 1
                total += layer_sizes[start]
            if stage == 0 and start > 0:
                return None
            bounds.append(range(start, stop))
            stop = start
        return list(reversed(bounds))

    low = max(layer_sizes)
    high = sum(layer_sizes) + first_extra + last_extra
    while low < high:
        middle = (low + high) // 2
        if cut(middle) is None:
            low = middle + 1
        else:
            high = middle
    split = cut(low)
    assert split is not None  # the total always fits
    return split


def stage_layers(config: ModelConfig, stages: int) -> list[range]:
    """The layers each pipeline stage holds, balanced by parameter bytes."""
    layer, embedding, head = layer_bytes(config)
    return split_layers([layer] * config.num_layers, stages, embedding, head)

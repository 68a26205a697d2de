"""What the profiler measured and what it knew about the platform and the model: plain values.

These types cross from the profiler (which needs the engine and the hardware) to the recommender
(a pure function), and are written into the ``measurements`` section of the tune YAML, so that
every recommended value can be traced to the numbers behind it.

Invariant: times are in seconds, the best of ``repeats`` runs; ``None`` means "not measured".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class PlatformFacts:
    """The hardware the recommendation is for."""

    name: str  # cpu, cuda, kunlun
    num_cards: int  # cards this process may use (1 for the CPU)
    memory_bytes_per_card: int  # memory one card offers the engine (CPU: available host memory)
    memory_source: str  # where memory_bytes_per_card came from, for the explanation


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """The model as loaded for profiling."""

    name: str
    dtype: str  # torch dtype name without the "torch." prefix
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    weight_bytes: int  # parameters and buffers in the engine's dtype
    max_model_len: int  # the context length the recommendation provides for
    # Where the weights are narrower than the activations (FP32 over BF16 weights on CPUs without
    # native BF16, what --dtype auto runs there); None when they are the same.
    weight_dtype: str | None = None


@dataclass(frozen=True, slots=True)
class ModelParts:
    """The model by part, as tensor and pipeline parallelism split it."""

    hidden_size: int  # width of the hidden states that cross a stage boundary
    intermediate_size: int  # MLP width, which a TP size must divide (as the head counts)
    vocab_size: int  # width of the logits the last stage returns to the leader
    layer_bytes: int  # one decoder layer (all alike), split T ways
    embedding_bytes: int  # the token embedding: on the first stage, whole on each of its cards
    head_bytes: int  # final norm + lm_head: on the last stage, whole (a tied lm_head counted in full)


@dataclass(frozen=True, slots=True)
class PrefillPoint:
    """One prefill step of ``num_tokens`` tokens (one sequence, empty KV cache)."""

    num_tokens: int
    step_seconds: float
    repeats: int
    peak_memory_bytes: int | None  # activation memory above the loaded engine; None if unknown

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.step_seconds


@dataclass(frozen=True, slots=True)
class DecodePoint:
    """One decode step of ``num_seqs`` sequences, each with ``context_tokens`` tokens of context."""

    num_seqs: int
    context_tokens: int
    step_seconds: float
    repeats: int

    @property
    def tokens_per_second(self) -> float:
        return self.num_seqs / self.step_seconds


@dataclass(frozen=True, slots=True)
class BlockSizePoint:
    """Decode with one KV block size, and what that block size costs in KV memory."""

    block_size: int
    num_seqs: int
    context_tokens: int
    decode_step_seconds: float
    kv_bytes_per_token: int  # K and V of all layers, block padding (alignment, skew) included
    repeats: int


@dataclass(frozen=True, slots=True)
class Measurements:
    """Everything one profiling run produced."""

    platform: PlatformFacts
    model: ModelFacts
    prefill: tuple[PrefillPoint, ...]
    decode: tuple[DecodePoint, ...]
    block_sizes: tuple[BlockSizePoint, ...]
    # block size → bytes of one KV block (K and V, all layers, padding included) as the engine lays
    # it out on this platform: arithmetic, known for every block size even when not timed
    kv_block_bytes: dict[int, int]
    budget_seconds: float
    elapsed_seconds: float
    skipped: tuple[str, ...] = field(default=())  # sweep points left out to stay within the budget
    parts: ModelParts | None = None  # None: not recorded (tune files from before pipeline parallelism)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Measurements:
        """Rebuild from ``to_dict()`` output (e.g. a tune YAML's ``measurements`` section)."""
        return cls(
            platform=PlatformFacts(**data["platform"]),
            model=ModelFacts(**data["model"]),
            prefill=tuple(PrefillPoint(**p) for p in data["prefill"]),
            decode=tuple(DecodePoint(**p) for p in data["decode"]),
            block_sizes=tuple(BlockSizePoint(**p) for p in data["block_sizes"]),
            kv_block_bytes={int(size): int(nbytes) for size, nbytes in data["kv_block_bytes"].items()},
            budget_seconds=data["budget_seconds"],
            elapsed_seconds=data["elapsed_seconds"],
            skipped=tuple(data.get("skipped", ())),
            parts=ModelParts(**data["parts"]) if data.get("parts") else None,
        )

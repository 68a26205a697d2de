"""Does a model fit its XPUs? Weights plus the KV cache of one full-length sequence, in bytes.

Owns: the memory estimate the admission webhook reports (with its numbers) and the startup-probe
budget that grows with model size. Pure; a rough, documented estimate, not a profiler:
weights = parameters × bytes per parameter (2 for 16-bit, 4 for float32, 1 for int8);
KV cache = 2 × layers × KV heads × head dim × 2 bytes × maxModelLen; usable memory = 90 % of
xpus × card memory (the rest is activations, the runtime and fragmentation). A multi-node replica
(``pipelineParallelSize`` P pods of ``xpus`` cards, T = ``tensorParallelSize``) splits the layers
into P stages and each stage T ways, so every card holds weights / (T·P) and its share of the KV
cache: the check is the same sum against the memory of all P × xpus cards. With LoRA on, the
adapters in the engine's slots count too: ``maxLoras`` slots, each the size of the largest adapter
that declares a ``size`` (the runtime pads every slot to one rank); adapters without a size are
not counted, and the estimate says how many those are.
"""

from __future__ import annotations

from dataclasses import dataclass

from kunlun_operator.spec.values import InferenceSpec

GiB = 2**30
USABLE_FRACTION = 0.9
#: Startup budget: a fixed part for the process and the XPU runtime, plus load time per GiB.
STARTUP_BASE_SECONDS = 300
STARTUP_SECONDS_PER_GIB = 20
STARTUP_UNKNOWN_SIZE_SECONDS = 900
STARTUP_MAX_SECONDS = 3600
#: A multi-node group also waits for its workers (scheduled and pulled on other nodes) and for the
#: collective preflight across every rank before the leader reports healthy.
STARTUP_GROUP_SECONDS = 180


@dataclass(frozen=True, slots=True)
class AdapterEstimate:
    """The LoRA slots' share: ``num_slots`` (maxLoras) × the largest declared adapter size."""

    num_slots: int
    slot_bytes: int
    num_unsized: int  # adapters without ``size``: not counted

    @property
    def total_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def describe(self) -> str:
        unsized = f", {self.num_unsized} adapter(s) without size not counted" if self.num_unsized else ""
        return f"LoRA adapters {self.total_bytes / GiB:.1f} GiB ({self.num_slots} slot(s){unsized})"


def estimate_adapters(spec: InferenceSpec) -> AdapterEstimate | None:
    """The adapters' part of the estimate; None with LoRA off."""
    lora = spec.runtime.lora
    if lora is None:
        return None
    sizes = [a.size_bytes for a in spec.model.adapters if a.size_bytes is not None]
    return AdapterEstimate(lora.max_loras, max(sizes, default=0), len(spec.model.adapters) - len(sizes))


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    weights_bytes: int
    kv_cache_bytes: int | None  # None when the architecture or maxModelLen is unknown
    available_bytes: int
    card_memory_bytes: int
    num_xpus: int  # all cards of one replica: xpus per pod × pods
    num_nodes: int = 1  # pods (pipeline stages) of one replica
    adapters: AdapterEstimate | None = None  # None: LoRA off

    @property
    def required_bytes(self) -> int:
        adapters = self.adapters.total_bytes if self.adapters is not None else 0
        return self.weights_bytes + (self.kv_cache_bytes or 0) + adapters

    @property
    def fits(self) -> bool:
        return self.required_bytes <= self.available_bytes

    def describe(self) -> str:
        kv = (
            "not estimated (set model.architecture and runtime.maxModelLen)"
            if self.kv_cache_bytes is None
            else f"{self.kv_cache_bytes / GiB:.1f} GiB"
        )
        adapters = "" if self.adapters is None else f" + {self.adapters.describe()}"
        return (
            f"weights {self.weights_bytes / GiB:.1f} GiB + KV cache {kv}{adapters} = "
            f"{self.required_bytes / GiB:.1f} GiB; available {self.available_bytes / GiB:.1f} GiB "
            f"({USABLE_FRACTION:.0%} of {self.cards()} × {self.card_memory_bytes / GiB:.0f} GiB)"
        )

    def cards(self) -> str:
        """``"8"``, or ``"2 nodes × 8"`` for a multi-node replica."""
        if self.num_nodes == 1:
            return str(self.num_xpus)
        return f"{self.num_nodes} nodes × {self.num_xpus // self.num_nodes}"


def bytes_per_parameter(spec: InferenceSpec) -> float:
    if spec.runtime.quantization == "int8":
        return 1.0
    return 4.0 if spec.runtime.dtype == "float32" else 2.0


def weights_bytes(spec: InferenceSpec) -> int | None:
    if spec.model.num_parameters is None:
        return None
    return int(spec.model.num_parameters * bytes_per_parameter(spec))


def estimate_memory(spec: InferenceSpec, card_memory_bytes: int) -> MemoryEstimate | None:
    """The estimate for ``spec`` on cards of ``card_memory_bytes``; None without ``model.parameters``."""
    weights = weights_bytes(spec)
    if weights is None:
        return None
    arch, max_len = spec.model.architecture, spec.runtime.max_model_len
    kv = (
        None
        if arch is None or max_len is None
        else 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 2 * max_len
    )
    num_nodes = spec.runtime.pipeline_parallel_size
    num_xpus = spec.resources.xpus * num_nodes
    return MemoryEstimate(
        weights,
        kv,
        int(num_xpus * card_memory_bytes * USABLE_FRACTION),
        card_memory_bytes,
        num_xpus,
        num_nodes,
        estimate_adapters(spec),
    )


def startup_budget_seconds(spec: InferenceSpec) -> int:
    """How long a replica may take to load before the startup probe gives up.

    A multi-node replica is ready when its whole group is: the load time of the whole model (the
    stages read their shares at once, usually from one shared source, so its bandwidth bounds
    them), plus ``STARTUP_GROUP_SECONDS`` for the workers and the group's collective preflight.
    """
    if spec.runtime.startup_timeout_seconds is not None:
        return spec.runtime.startup_timeout_seconds
    group = STARTUP_GROUP_SECONDS if spec.multi_node else 0
    weights = weights_bytes(spec)
    if weights is None:
        return STARTUP_UNKNOWN_SIZE_SECONDS + group
    load = min(STARTUP_MAX_SECONDS, STARTUP_BASE_SECONDS + round(STARTUP_SECONDS_PER_GIB * weights / GiB))
    return load + group

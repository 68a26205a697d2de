"""Engine configuration: every knob of the engine, validated once.

Each field has a CLI flag of the same name (``max_num_seqs`` → ``--max-num-seqs``); names follow
vLLM where they overlap. Nothing here touches torch or the model files: the model-dependent checks
(``max_model_len`` against the model, KV budget against one sequence) happen where the model is known.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal, get_args

from kunlun_runtime.errors import ConfigError

# The string options, as types for the code and as sets for validating what users pass in.
DTypeName = Literal["auto", "float32", "bfloat16", "float16"]
KVCacheDTypeName = Literal["auto", "bfloat16", "float32"]  # what the paged KV cache stores
DeviceName = Literal["auto", "cpu", "cuda", "kunlun"]
LinearBackendName = Literal["auto", "plain", "prepacked", "native"]
QuantizationName = Literal["int8"]
SchedulingPolicyOption = Literal["fixed", "feedback"]  # engine.scheduling_policy.SchedulingPolicyName

DTYPES: frozenset[str] = frozenset(get_args(DTypeName))
KV_CACHE_DTYPES: frozenset[str] = frozenset(get_args(KVCacheDTypeName))
DEVICES: frozenset[str] = frozenset(get_args(DeviceName))
LINEAR_BACKENDS: frozenset[str] = frozenset(get_args(LinearBackendName))
QUANTIZATIONS: frozenset[str] = frozenset(get_args(QuantizationName))
SCHEDULING_POLICIES: frozenset[str] = frozenset(get_args(SchedulingPolicyOption))
DEFAULT_KV_CACHE_MEMORY_BYTES = 1 << 30
DEFAULT_MASTER_PORT = 29500  # where the leader listens for the other nodes (torch.distributed's usual port)

_MEMORY_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)


def parse_memory(text: str | int, *, field_name: str = "kv_cache_memory") -> int:
    """Parse a memory size: a byte count or a number with a unit (``4GiB``, ``512MiB``, ``2G``).

    Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB, G) powers of 1000.
    Raises ConfigError naming ``field_name`` for anything else.
    """
    if isinstance(text, int):
        value = text
    else:
        match = _MEMORY_RE.match(text)
        if not match:
            raise ConfigError(
                f"{field_name}: cannot parse memory size {text!r} (e.g. 2GiB)", field=field_name
            )
        number, unit = match.group(1), (match.group(2) or "").lower()
        base = 1024 if "i" in unit else 1000
        scale = base ** "bkmgt".index(unit[0]) if unit else 1
        value = int(float(number) * scale)
    if value <= 0:
        raise ConfigError(f"{field_name}: must be positive, got {text!r}", field=field_name)
    return value


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """All engine options. Construct with keywords, then call ``validate()`` (``LLM`` does)."""

    model: str | None = None  # HF-format directory; None = the embedded default model
    served_model_name: str | None = None
    dtype: DTypeName = "auto"  # auto = bfloat16 where the platform supports it
    # auto = the activations' dtype, but BF16 where they are FP32 for want of native BF16 (kv/kv_dtype.py)
    kv_cache_dtype: KVCacheDTypeName = "auto"
    device: DeviceName = "auto"
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_MEMORY_BYTES
    enable_prefix_caching: bool = True
    max_preemptions: int = 3  # preempted this often, a request is protected (bounds recompute; no starvation)
    priority_aging_steps: int = 256  # a waiting request gains one priority level per this many steps
    scheduling_policy: SchedulingPolicyOption = "fixed"  # feedback: time-capped prefill (docs/scheduling.md)
    target_step_seconds: float | None = None  # feedback: cap while decodes run; None = derived
    kv_block_skew: bool = True  # skew block starts across cache sets (why: kv/block_layout.py)
    # auto: our kernels where this CPU's tier has them, else oneDNN-prepacked where its BF16 runs, else plain
    linear_backend: LinearBackendName = "auto"
    fused_attention: bool = True  # one fused SDPA call per layer (False: unfused, for ablations)
    native_kernels: bool = True  # our RMSNorm, SiLU and fused decode attention where the tier has them
    # A CPU that runs our kernels but whose library fails to build or load is a start error, not
    # the plain fallback (--require-native-kernels, $KUNLUN_REQUIRE_NATIVE_KERNELS; the images set it).
    require_native_kernels: bool = False
    tensor_parallel_size: int = 1
    # Pipeline parallelism: stages, nodes, and where they meet (docs/multinode.md).
    pipeline_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0  # 0: the leader, which serves; others follow it
    master_addr: str = "127.0.0.1"  # the leader's address, where every rank joins
    master_port: int | None = None  # None: a free port on one node, DEFAULT_MASTER_PORT across nodes
    distributed_timeout_seconds: float = 60.0  # a rank silent this long fails the group
    # How long a worker node retries the leader's rendezvous port before it exits 1; None: the
    # distributed timeout. Under LeaderWorkerSet the leader's pod may still be pulling its image or
    # model, so the operator passes its startup budget here rather than lengthening every step's.
    leader_wait_timeout_seconds: float | None = None
    quantization: QuantizationName | None = None
    seed: int = 0
    extra: dict[str, str] = field(default_factory=dict)

    def validate(self) -> EngineConfig:
        """Check every field on its own; return self. Raises ConfigError naming the field."""
        _check(self.dtype in DTYPES, "dtype", f"must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        _check(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            "kv_cache_dtype",
            f"must be one of {sorted(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}",
        )
        _check(self.device in DEVICES, "device", f"must be one of {sorted(DEVICES)}, got {self.device!r}")
        _check(
            self.block_size in (8, 16, 32, 64, 128),
            "block_size",
            f"must be 8, 16, 32, 64 or 128, got {self.block_size}",
        )
        _check(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        _check(
            self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            f"must be >= 1, got {self.max_num_batched_tokens}",
        )
        _check(self.kv_cache_memory_bytes > 0, "kv_cache_memory", "must be positive")
        _check(self.max_preemptions >= 0, "max_preemptions", f"must be >= 0, got {self.max_preemptions}")
        _check(self.priority_aging_steps >= 1, "priority_aging_steps", "must be >= 1")
        _check(
            self.scheduling_policy in SCHEDULING_POLICIES,
            "scheduling_policy",
            f"must be one of {sorted(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}",
        )
        if self.target_step_seconds is not None:
            _check(
                0 < self.target_step_seconds < float("inf"),
                "target_step_seconds",
                f"must be a positive number of seconds, got {self.target_step_seconds}",
            )
        _check(
            self.linear_backend in LINEAR_BACKENDS,
            "linear_backend",
            f"must be one of {sorted(LINEAR_BACKENDS)}, got {self.linear_backend!r}",
        )
        for name in ("native_kernels", "require_native_kernels"):
            _check(
                isinstance(getattr(self, name), bool),
                name,
                f"must be true or false, got {getattr(self, name)!r}",
            )
        _check(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1")
        _check(self.pipeline_parallel_size >= 1, "pipeline_parallel_size", "must be >= 1")
        _check(self.nnodes >= 1, "nnodes", f"must be >= 1, got {self.nnodes}")
        _check(
            0 <= self.node_rank < self.nnodes,
            "node_rank",
            f"must be in [0, {self.nnodes}) for {self.nnodes} node(s), got {self.node_rank}",
        )
        world = self.tensor_parallel_size * self.pipeline_parallel_size
        _check(
            world % self.nnodes == 0 and (world // self.nnodes) % self.tensor_parallel_size == 0,
            "nnodes",
            f"{self.nnodes} nodes must each run whole stages of tensor_parallel_size "
            f"{self.tensor_parallel_size} (pipeline_parallel_size {self.pipeline_parallel_size}: "
            f"at most {self.pipeline_parallel_size} nodes, a divisor of it)",
        )
        if self.master_port is not None:
            _check(
                1 <= self.master_port <= 65535, "master_port", f"must be a TCP port, got {self.master_port}"
            )
        _check(
            1 <= self.distributed_timeout_seconds < float("inf"),
            "distributed_timeout",
            f"must be at least 1 second (idle keepalives go every third of it), got {self.distributed_timeout_seconds}",
        )
        _check(
            self.leader_wait_timeout_seconds is None or 1 <= self.leader_wait_timeout_seconds < float("inf"),
            "leader_wait_timeout",
            f"must be at least 1 second, got {self.leader_wait_timeout_seconds}",
        )
        _check(
            self.quantization is None or self.quantization in QUANTIZATIONS,
            "quantization",
            f"must be one of {sorted(QUANTIZATIONS)} or unset, got {self.quantization!r}",
        )
        if self.max_model_len is not None:
            _check(self.max_model_len >= 1, "max_model_len", f"must be >= 1, got {self.max_model_len}")
        return self


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{field_name}: {message}", field=field_name)

"""Engine configuration: every knob of the engine, validated once.

Each field has a CLI flag of the same name (``max_num_seqs`` → ``--max-num-seqs``); names follow
vLLM where they overlap. Nothing here touches torch or the model files: the model-dependent checks
(``max_model_len`` against the model, KV budget against one sequence) happen where the model is known.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, TypeGuard, get_args

from kunlun_runtime.errors import ConfigError

# The string options, as types for the code and as sets for validating what users pass in.
DTypeName = Literal["auto", "float32", "bfloat16", "float16"]
KVCacheDTypeName = Literal["auto", "bfloat16", "float32"]  # what the paged KV cache stores
DeviceName = Literal["auto", "cpu", "cuda", "kunlun"]
LinearBackendName = Literal["auto", "plain", "prepacked", "native"]
QuantizationName = Literal["int8"]
SchedulingPolicyOption = Literal["fixed", "feedback"]  # engine.scheduling_policy.SchedulingPolicyName
# keyed_blake2b: ours, keyed per process (no outsider can recompute it); sha256, sha256_cbor: vLLM's
# (an indexer can recompute them from tokens and PYTHONHASHSEED). kv/prefix_hash.py has the details.
PrefixCachingHashAlgoName = Literal["keyed_blake2b", "sha256", "sha256_cbor"]
KVEventsPublisherName = Literal["null", "zmq"]
# How KV events are encoded (kv/kv_events.py): array as vLLM up to 0.23, map as vLLM since.
KVEventsEncoding = Literal["array", "map"]

DTYPES: frozenset[str] = frozenset(get_args(DTypeName))
KV_CACHE_DTYPES: frozenset[str] = frozenset(get_args(KVCacheDTypeName))
DEVICES: frozenset[str] = frozenset(get_args(DeviceName))
LINEAR_BACKENDS: frozenset[str] = frozenset(get_args(LinearBackendName))
QUANTIZATIONS: frozenset[str] = frozenset(get_args(QuantizationName))
SCHEDULING_POLICIES: frozenset[str] = frozenset(get_args(SchedulingPolicyOption))
PREFIX_CACHING_HASH_ALGOS: frozenset[str] = frozenset(get_args(PrefixCachingHashAlgoName))
KV_EVENTS_PUBLISHERS: frozenset[str] = frozenset(get_args(KVEventsPublisherName))
KV_EVENTS_ENCODINGS: frozenset[str] = frozenset(get_args(KVEventsEncoding))
DEFAULT_KV_CACHE_MEMORY_BYTES = 1 << 30
DEFAULT_MASTER_PORT = 29500  # where the leader listens for the other nodes (torch.distributed's usual port)

_MEMORY_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
# A ZeroMQ endpoint: tcp://HOST:PORT (HOST a name, an address, [IPv6] or * for every interface),
# ipc://PATH or inproc://NAME.
_ENDPOINT_RE = re.compile(
    r"^(?:tcp://(?:\*|\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>\d{1,5})|(?:ipc|inproc)://\S+)$"
)


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
class KVEventsConfig:
    """vLLM's ``KVEventsConfig`` (``--kv-events-config JSON``): the same keys, defaults and meaning.

    With events on, the engine publishes the prefix cache's block events (kv/kv_events.py) on a
    ZeroMQ PUB socket at ``endpoint`` (bound when it names ``*``, ``::``, ``ipc://`` or
    ``inproc://``, else connected, as vLLM does) and answers replay requests on ``replay_endpoint``.
    """

    enable_kv_cache_events: bool = False
    publisher: KVEventsPublisherName | None = None  # None: "zmq" when events are on, else "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None  # a ROUTER socket resending batches from a sequence number
    buffer_steps: int = 10_000  # batches (one per engine step with events) kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark: ZeroMQ drops beyond it per subscriber
    max_queue_size: int = 100_000  # batches waiting for the publisher thread; beyond, the oldest drop
    topic: str = ""  # the first frame of every message; subscribers filter on its prefix

    @property
    def publishes(self) -> bool:
        """Whether the engine publishes: events on and the publisher ``zmq`` (given or implied)."""
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"

    def validate(self) -> KVEventsConfig:
        """Check every key; return self. Raises ConfigError naming ``kv_events_config.<key>``."""
        for name in ("buffer_steps", "max_queue_size"):
            value = getattr(self, name)
            _check_key(_is_int(value) and value >= 1, name, f"must be an integer >= 1, got {value!r}")
        _check_key(_is_int(self.hwm) and self.hwm >= 0, "hwm", f"must be an integer >= 0, got {self.hwm!r}")
        _check_key(
            self.publisher is None or self.publisher in KV_EVENTS_PUBLISHERS,
            "publisher",
            f"must be one of {sorted(KV_EVENTS_PUBLISHERS)}, got {self.publisher!r}",
        )
        _check_key(isinstance(self.topic, str), "topic", f"must be a string, got {self.topic!r}")
        _check_key(
            isinstance(self.enable_kv_cache_events, bool),
            "enable_kv_cache_events",
            f"must be true or false, got {self.enable_kv_cache_events!r}",
        )
        _check_endpoint("endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            _check_endpoint("replay_endpoint", self.replay_endpoint)
            _check_key(
                self.replay_endpoint != self.endpoint,
                "replay_endpoint",
                f"must differ from endpoint, both are {self.endpoint!r}",
            )
        return self


KV_EVENTS_KEYS: tuple[str, ...] = tuple(f.name for f in fields(KVEventsConfig))


def parse_kv_events_config(value: KVEventsConfig | Mapping[str, Any] | str | None) -> KVEventsConfig | None:
    """vLLM's KV events configuration from its JSON text, a mapping of its keys or itself (None
    stays None). Raises ConfigError naming ``kv_events_config`` or ``kv_events_config.<key>``:
    text that is not a JSON object, a key vLLM does not have, a value of the wrong type or range."""
    if value is None or isinstance(value, KVEventsConfig):
        return None if value is None else value.validate()
    value = _json_object(
        value,
        "kv_events_config",
        '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}',
        "of vLLM's KVEventsConfig keys",
    )
    for key in value:
        _check_key(key in KV_EVENTS_KEYS, str(key), f"unknown key; the keys are {', '.join(KV_EVENTS_KEYS)}")
    for key in ("endpoint", "topic"):
        if key in value:
            _check_key(isinstance(value[key], str), key, f"must be a string, got {value[key]!r}")
    return KVEventsConfig(**value).validate()


SPECULATIVE_METHODS = ("ngram", "suffix")
# The keys each method reads beside method and num_speculative_tokens. A key of the other method is
# refused rather than ignored: a wrong method never runs quietly with settings meant for another.
SPECULATIVE_METHOD_KEYS: dict[str, tuple[str, ...]] = {
    "ngram": ("prompt_lookup_max", "prompt_lookup_min"),
    "suffix": (
        "suffix_decoding_max_tree_depth",
        "suffix_decoding_max_cached_requests",
        "suffix_decoding_max_spec_factor",
        "suffix_decoding_min_token_prob",
    ),
}
# What a key left out means, per method (vLLM's defaults; suffix drafts up to vLLM's tree depth, 24).
SPECULATIVE_DEFAULTS: dict[str, dict[str, int | float]] = {
    "ngram": {"num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1},
    "suffix": {
        "num_speculative_tokens": 24,
        "suffix_decoding_max_tree_depth": 24,
        "suffix_decoding_max_cached_requests": 10000,
        "suffix_decoding_max_spec_factor": 1.0,
        "suffix_decoding_min_token_prob": 0.1,
    },
}
SPECULATIVE_KEYS: tuple[str, ...] = (
    "method",
    "num_speculative_tokens",
    *(key for keys in SPECULATIVE_METHOD_KEYS.values() for key in keys),
)


@dataclass(frozen=True, slots=True, init=False)
class SpeculativeConfig:
    """vLLM's ``--speculative-config`` for model-free drafting, at most ``num_speculative_tokens``
    drafts a step. ``ngram`` proposes the tokens that followed the first occurrence of the
    sequence's last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``);
    ``suffix`` follows the most frequent continuations in suffix trees of the request's own tokens
    and of its tenant's earlier outputs (engine/suffix_tree.py, engine/suffix_cache.py).

    A key left out (None) takes its method's default (``SPECULATIVE_DEFAULTS``) at construction,
    so ``num_speculative_tokens`` and the method's own keys are always set; the other method's
    keys stay None, and ``validate`` refuses any that is set. The constructor is written out
    (``init=False``) because a default that depends on ``method`` is not a dataclass default."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None
    prompt_lookup_min: int | None
    suffix_decoding_max_tree_depth: int | None
    suffix_decoding_max_cached_requests: int | None
    suffix_decoding_max_spec_factor: float | None
    suffix_decoding_min_token_prob: float | None

    def __init__(
        self,
        method: str = "ngram",
        num_speculative_tokens: int | None = None,
        prompt_lookup_max: int | None = None,
        prompt_lookup_min: int | None = None,
        suffix_decoding_max_tree_depth: int | None = None,
        suffix_decoding_max_cached_requests: int | None = None,
        suffix_decoding_max_spec_factor: float | None = None,
        suffix_decoding_min_token_prob: float | None = None,
    ) -> None:
        values: dict[str, object] = {
            "method": method,
            "num_speculative_tokens": num_speculative_tokens,
            "prompt_lookup_max": prompt_lookup_max,
            "prompt_lookup_min": prompt_lookup_min,
            "suffix_decoding_max_tree_depth": suffix_decoding_max_tree_depth,
            "suffix_decoding_max_cached_requests": suffix_decoding_max_cached_requests,
            "suffix_decoding_max_spec_factor": suffix_decoding_max_spec_factor,
            "suffix_decoding_min_token_prob": suffix_decoding_min_token_prob,
        }
        for key, default in SPECULATIVE_DEFAULTS.get(method, {}).items():
            if values[key] is None:
                values[key] = default
        for key, value in values.items():  # frozen: set once, as a dataclass's own __init__ does
            object.__setattr__(self, key, value)

    def validate(self) -> SpeculativeConfig:
        _check_speculative(
            self.method in SPECULATIVE_METHODS,
            "method",
            f"must be one of {list(SPECULATIVE_METHODS)}, got {self.method!r}",
        )
        for method, keys in SPECULATIVE_METHOD_KEYS.items():
            for key in keys:
                _check_speculative(
                    method == self.method or getattr(self, key) is None,
                    key,
                    f"applies to method {method} only, not {self.method}",
                )
        _check_speculative_int("num_speculative_tokens", self.num_speculative_tokens, 1, 32)
        if self.method == "ngram":
            low = _check_speculative_int("prompt_lookup_min", self.prompt_lookup_min, 1, 32)
            high = _check_speculative_int("prompt_lookup_max", self.prompt_lookup_max, 1, 32)
            _check_speculative(
                low <= high, "prompt_lookup_min", f"must be <= prompt_lookup_max ({high}), got {low}"
            )
        else:
            self._validate_suffix()
        return self

    def _validate_suffix(self) -> None:
        _check_speculative_int("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth, 1, 64)
        _check_speculative_int(
            "suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests, 0
        )
        factor = self.suffix_decoding_max_spec_factor
        _check_speculative(
            _is_real(factor) and 0 < factor < math.inf,
            "suffix_decoding_max_spec_factor",
            f"must be a number > 0, got {factor!r}",
        )
        probability = self.suffix_decoding_min_token_prob
        _check_speculative(
            _is_real(probability) and 0 <= probability <= 1,
            "suffix_decoding_min_token_prob",
            f"must be a number in [0, 1], got {probability!r}",
        )


def _check_speculative(ok: bool, key: str, message: str) -> None:
    _check(ok, f"speculative_config.{key}", message)


def _check_speculative_int(key: str, value: object, low: int, high: int | None = None) -> int:
    """``value`` if it is an integer in [low, high] (no upper bound when ``high`` is None); else a
    ConfigError naming ``speculative_config.<key>``."""
    if _is_int(value) and value >= low and (high is None or value <= high):
        return value
    within = f"in [{low}, {high}]" if high is not None else f">= {low}"
    field_name = f"speculative_config.{key}"
    raise ConfigError(f"{field_name}: must be an integer {within}, got {value!r}", field=field_name)


def parse_speculative_config(
    value: SpeculativeConfig | Mapping[str, Any] | str | None,
) -> SpeculativeConfig | None:
    """vLLM's speculative configuration from its JSON text, a mapping or itself (None stays
    None). Raises ConfigError naming ``speculative_config`` or ``speculative_config.<key>``."""
    if value is None or isinstance(value, SpeculativeConfig):
        return None if value is None else value.validate()
    value = _json_object(
        value,
        "speculative_config",
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}',
    )
    for key in value:
        _check(
            key in SPECULATIVE_KEYS,
            f"speculative_config.{key}",
            f"unknown key; the keys are {', '.join(SPECULATIVE_KEYS)}",
        )
    return SpeculativeConfig(**value).validate()


def _json_object(value: object, field_name: str, example: str, what: str = "") -> Mapping[str, Any]:
    """``value`` as a mapping: JSON text is parsed; anything but an object is a ConfigError
    naming ``field_name`` (with ``example`` of a good value)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ConfigError(
                f"{field_name}: not valid JSON ({error}); e.g. '{example}'", field=field_name
            ) from None
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"{field_name}: must be a JSON object{' ' + what if what else ''}, got {value!r}",
            field=field_name,
        )
    return value


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_endpoint(key: str, endpoint: object) -> None:
    match = _ENDPOINT_RE.match(endpoint) if isinstance(endpoint, str) else None
    _check_key(
        match is not None and (match["port"] is None or 1 <= int(match["port"]) <= 65535),
        key,
        f"must be a ZeroMQ endpoint such as tcp://*:5557, tcp://HOST:PORT, ipc://PATH or inproc://NAME, "
        f"got {endpoint!r}",
    )


def _check_key(ok: bool, key: str, message: str) -> None:
    _check(ok, f"kv_events_config.{key}", message)


MAX_LORA_RANK = 512  # vLLM's largest supported --max-lora-rank


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
    # How full blocks are hashed for the prefix cache (and named in KV events): kv/prefix_hash.py.
    prefix_caching_hash_algo: PrefixCachingHashAlgoName = "keyed_blake2b"
    # vLLM's KV cache events (None: off): block stored/removed/cleared on ZeroMQ (docs/server.md).
    kv_events_config: KVEventsConfig | None = None
    kv_events_encoding: KVEventsEncoding = "array"  # each event an array (vLLM <= 0.23) or a map
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
    # Speculative decoding (vLLM's --speculative-config; None: off): engine/spec_decode.py.
    speculative_config: SpeculativeConfig | None = None
    # LoRA adapters (vLLM's flags): off unless enabled; adapters in one batch, their largest rank,
    # and how many stay loaded in host memory (least recently used unloaded beyond; None: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
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
        _check(
            self.prefix_caching_hash_algo in PREFIX_CACHING_HASH_ALGOS,
            "prefix_caching_hash_algo",
            f"must be one of {sorted(PREFIX_CACHING_HASH_ALGOS)}, got {self.prefix_caching_hash_algo!r}",
        )
        _check(
            self.kv_events_encoding in KV_EVENTS_ENCODINGS,
            "kv_events_encoding",
            f"must be one of {sorted(KV_EVENTS_ENCODINGS)}, got {self.kv_events_encoding!r}",
        )
        self._validate_kv_events()
        self._validate_lora()
        if self.speculative_config is not None:
            _check(
                isinstance(self.speculative_config, SpeculativeConfig),
                "speculative_config",
                f"must be a SpeculativeConfig (parse_speculative_config reads JSON), got {self.speculative_config!r}",
            )
            self.speculative_config.validate()
        return self

    def _validate_lora(self) -> None:
        _check(
            isinstance(self.enable_lora, bool),
            "enable_lora",
            f"must be true or false, got {self.enable_lora!r}",
        )
        _check(self.max_loras >= 1, "max_loras", f"must be >= 1, got {self.max_loras}")
        _check(
            1 <= self.max_lora_rank <= MAX_LORA_RANK,
            "max_lora_rank",
            f"must be in [1, {MAX_LORA_RANK}], got {self.max_lora_rank}",
        )
        if self.max_cpu_loras is not None:
            _check(
                self.max_cpu_loras >= self.max_loras,
                "max_cpu_loras",
                f"must be >= max_loras ({self.max_loras}): a batch's adapters stay loaded, got {self.max_cpu_loras}",
            )

    @property
    def lora_cache_size(self) -> int:
        """How many adapters stay loaded in host memory (``max_cpu_loras``, else ``max_loras``)."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    def _validate_kv_events(self) -> None:
        if self.kv_events_config is None:
            return
        _check(
            isinstance(self.kv_events_config, KVEventsConfig),
            "kv_events_config",
            f"must be a KVEventsConfig (parse_kv_events_config reads JSON), got {self.kv_events_config!r}",
        )
        self.kv_events_config.validate()
        _check(
            not self.kv_events_config.enable_kv_cache_events or self.enable_prefix_caching,
            "kv_events_config",
            "enable_kv_cache_events needs prefix caching: the events describe the prefix cache's "
            "blocks (drop --no-enable-prefix-caching)",
        )


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{field_name}: {message}", field=field_name)

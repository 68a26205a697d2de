"""Parse a HF ``config.json`` into a frozen ``ModelConfig`` the decoder model is built from.

Both config dialects found on published checkpoints load: ``rope_theta`` + ``rope_scaling`` (older
transformers) and ``rope_parameters`` (newer). Unknown architectures and unsupported rope types are
refused with a message naming them and the supported list.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kunlun_runtime.errors import ModelLoadError
from kunlun_runtime.layers.rotary import RopeConfig

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = frozenset({"default", "linear", "llama3"})


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (Qwen2; optional on Llama)
    qk_norm: bool  # RMSNorm over head_dim on q and k before rotary (Qwen3)
    sliding_window: int | None  # attention window; None = full attention
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    hidden_act: str = "silu"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def load_model_config(model_dir: Path) -> ModelConfig:
    """Read ``model_dir/config.json``. Raises ModelLoadError naming the file or the field."""
    path = model_dir / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError as error:
        raise ModelLoadError(f"{path}: missing (a HF-format model directory needs config.json)") from error
    except (OSError, json.JSONDecodeError) as error:
        raise ModelLoadError(f"{path}: not valid JSON ({error})") from error
    return parse_model_config(raw, source=str(path))


def parse_model_config(raw: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
    """Build a ModelConfig from a config.json dict (see load_model_config)."""
    architectures = raw.get("architectures") or []
    architecture = architectures[0] if architectures else None
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{source}: unsupported architecture {architecture!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    try:
        hidden_size = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        head_dim = int(raw.get("head_dim") or hidden_size // num_heads)
        if raw.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ModelLoadError(f"{source}: hidden_act {raw.get('hidden_act')!r} is not supported (silu)")
        config = ModelConfig(
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=_parse_rope(raw, source),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=architecture == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
            qk_norm=architecture == "Qwen3ForCausalLM",
            sliding_window=_parse_sliding_window(raw, architecture),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_as_ids(raw.get("eos_token_id")),
        )
    except KeyError as error:
        raise ModelLoadError(f"{source}: missing required field {error.args[0]!r}") from error
    if num_heads % num_kv_heads:
        raise ModelLoadError(
            f"{source}: num_attention_heads ({num_heads}) is not a multiple of "
            f"num_key_value_heads ({num_kv_heads})"
        )
    return config


def _parse_rope(raw: dict[str, Any], source: str) -> RopeConfig:
    # Newer transformers: rope_parameters = {rope_type, rope_theta, factor, ...};
    # older: rope_theta at the top level and rope_scaling = {rope_type|type, factor, ...} or None.
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        scaling = params
        theta = float(params["rope_theta"])
    else:
        scaling = raw.get("rope_scaling") or {}
        theta = float(raw.get("rope_theta", 10000.0))
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: rope type {rope_type!r} is not supported; supported: {sorted(SUPPORTED_ROPE_TYPES)}"
        )
    original = scaling.get("original_max_position_embeddings")
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(scaling.get("factor", 1.0)),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original) if original else None,
    )


def _parse_sliding_window(raw: dict[str, Any], architecture: str) -> int | None:
    window = raw.get("sliding_window")
    if architecture.startswith("Qwen") and not raw.get("use_sliding_window", False):
        return None
    return int(window) if window else None


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return (int(value),)

"""What the server knows of the engine it serves, read once when the model has loaded.

``AsyncEngine`` reads them (``read_facts``) when it takes the engine over; the routes, the lifecycle
and the metrics then ask ``AsyncEngine.facts`` and never reach into the engine themselves. Nothing
here changes while the engine runs: what does (queue sizes, totals, telemetry) is asked of the
AsyncEngine when it is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kunlun_runtime.engine.llm_engine import LLMEngine
from kunlun_runtime.layers.runtime_info import RuntimeInfo
from kunlun_runtime.server.metrics import CacheConfigInfo


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """The served model and the engine's fixed configuration."""

    served_model_name: str  # the name /v1/models lists and requests may give
    max_model_len: int  # prompt + output tokens of one request
    vocab_size: int  # token ids are below it
    model_dir: Path  # where the weights were loaded from: never shown to clients
    runtime_info: RuntimeInfo  # backend, kernels, dtypes, KV capacity (/version, runtime_info)
    cache_config: CacheConfigInfo  # vllm:cache_config_info's labels
    enable_lora: bool = False  # --enable-lora: requests may name adapters


def read_facts(engine: LLMEngine) -> EngineFacts:
    """The facts of a loaded ``engine``."""
    config = engine.config
    return EngineFacts(
        served_model_name=engine.served_model_name,
        max_model_len=engine.max_model_len,
        vocab_size=engine.model_config.vocab_size,
        model_dir=engine.model_dir,
        runtime_info=engine.runtime_info,
        cache_config=CacheConfigInfo(
            block_size=config.block_size,
            num_gpu_blocks=engine.num_kv_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            cache_dtype=str(engine.kv_cache_dtype).removeprefix("torch."),
            kv_cache_memory_bytes=config.kv_cache_memory_bytes,
        ),
        enable_lora=config.enable_lora,
    )

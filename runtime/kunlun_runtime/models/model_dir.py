"""Which model a process serves: its directory, the name it is served under, its context length.

``--model`` names an HF-format directory; without it the embedded default model is converted
once and served (``default_model``, imported only then: it brings the GGUF importer along). The
context length is ``--max-model-len`` checked against the model, or the model's own limit. This
module decides only; it loads no weights.
"""

from __future__ import annotations

from pathlib import Path

from kunlun_runtime.config import EngineConfig
from kunlun_runtime.errors import ConfigError
from kunlun_runtime.models.model_config import ModelConfig

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the name the embedded default model is served under


def resolve_model_dir(model: str | None) -> Path:
    """The model directory: the given path, or the embedded default model (converted once).

    Raises ModelLoadError when the default model is wanted but its package is not installed.
    """
    if model is None:
        from kunlun_runtime.models.default_model import resolve_default_model

        return resolve_default_model()
    return Path(model)


def served_model_name(config: EngineConfig) -> str:
    """The name clients use: ``--served-model-name``, else the model directory's last part."""
    return config.served_model_name or (
        config.model.rstrip("/").split("/")[-1] if config.model else DEFAULT_MODEL_NAME
    )


def resolve_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    """The context length served: ``--max-model-len``, else the model's limit (its sliding window
    where it has one, when that is shorter).

    Raises ConfigError naming ``max_model_len`` when the asked-for length exceeds the model's
    sliding window (attention beyond it is not supported) or its ``max_position_embeddings``.
    """
    limit = model_config.max_position_embeddings
    window = model_config.sliding_window
    wanted = config.max_model_len
    if window is not None and wanted is not None and wanted > window:
        raise ConfigError(
            f"max_model_len: {wanted} exceeds the sliding window ({window}) of {model_config.architecture}; "
            "sliding-window attention beyond the window is not supported",
            field="max_model_len",
        )
    if wanted is not None and wanted > limit:
        raise ConfigError(
            f"max_model_len: {wanted} exceeds the model's max_position_embeddings ({limit})",
            field="max_model_len",
        )
    return wanted or (min(limit, window) if window else limit)

"""Build a ``DecoderModel`` from a HF-format directory: config, weights, fused projections.

HF weight names are mapped onto ours (q/k/v → ``qkv_proj``, gate/up → ``gate_up_proj``); a
missing weight is an error naming it; a tied checkpoint without ``lm_head.weight`` shares the
embedding. Matrices (linears, embedding) are cast once to the weight dtype, vectors (norms,
biases) to the compute dtype: on CPUs without native BF16 the weights stay BF16 while the
activations are FP32. A pipeline stage keeps only its layers (renumbered from 0), the embedding
on the first stage and the final norm and ``lm_head`` on the last; other weights are skipped.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from kunlun_runtime.errors import ConfigError, ModelLoadError
from kunlun_runtime.layers.linear import Int8Linear
from kunlun_runtime.layers.rotary import RotaryEmbedding
from kunlun_runtime.models.decoder import DecoderModel
from kunlun_runtime.models.model_config import ModelConfig, load_model_config
from kunlun_runtime.models.sharding import shard_model_config, shard_weight
from kunlun_runtime.models.weights import iter_weights

# HF projections loaded into one fused matrix → (that matrix, the piece's index); lora.checkpoint
# fuses adapters the same way.
FUSED_PROJECTIONS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER_RE = re.compile(
    r"^model\.layers\.(\d+)\.(self_attn\.[qkv]_proj|mlp\.(?:gate|up)_proj)\.(weight|bias)$"
)
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
_LAYER_PREFIX = re.compile(r"^layers\.(\d+)\.")


def _in_stage(name: str, layers: range, num_layers: int) -> str | None:
    """``name`` (ours, without ``model.``) as the stage holding ``layers`` numbers it, or None
    where another stage holds it."""
    match = _LAYER_PREFIX.match(name)
    if match:
        index = int(match.group(1))
        if index >= num_layers:
            return name  # no stage's: reported as unexpected
        return f"layers.{index - layers.start}.{name[match.end() :]}" if index in layers else None
    if name.startswith("embed_tokens."):
        return name if layers.start == 0 else None
    if name.startswith(("norm.", "lm_head.")) or name in ("norm", "lm_head"):
        return name if layers.stop == num_layers else None
    return name


def _stage_part(named: dict, layers: range, num_layers: int) -> dict:
    """The entries of ``named`` the stage holding ``layers`` keeps, renamed as it numbers them."""
    kept = {}
    for name, value in named.items():
        ours = _in_stage(name, layers, num_layers)
        if ours is not None:
            kept[ours] = value
    return kept


def load_model(
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    *,
    tp_rank: int = 0,
    tp_world: int = 1,
    compute_dtype: torch.dtype | None = None,
    layers: range | None = None,
) -> tuple[DecoderModel, ModelConfig]:
    """Load ``model_dir`` into a DecoderModel on ``device`` with weights in ``dtype`` and
    activations in ``compute_dtype`` (default: ``dtype``); with ``tp_world > 1`` only rank
    ``tp_rank``'s shard (``model.config`` then holds the per-rank shapes); with ``layers`` only
    that pipeline stage. Returns the model and the full model config.

    Raises ModelLoadError for an unsupported architecture, a missing/truncated file or weight,
    ConfigError when the model cannot be split ``tp_world`` ways.
    """
    config = load_model_config(model_dir)
    local_config = shard_model_config(config, tp_world) if tp_world > 1 else config
    layers = range(config.num_layers) if layers is None else layers
    with torch.device("meta"):
        model = DecoderModel(local_config, max_positions, tp_world=tp_world, layers=layers)
    params = dict(model.named_parameters())
    parts: dict[str, dict[int, torch.Tensor]] = {}
    state: dict[str, torch.Tensor] = {}
    quantized: dict[str, dict[str, torch.Tensor]] = {}  # linear module → int8 weight and scales

    def wanted(name: str) -> bool:
        """Read only this stage's weights (a rank of a large model must not hold all of them);
        the last stage also reads the embedding, its lm_head where the checkpoint has none."""
        ours = name.removeprefix("model.")
        if ours.startswith("embed_tokens.") and layers.stop == config.num_layers:
            return True
        return _in_stage(ours, layers, config.num_layers) is not None

    for name, tensor in iter_weights(model_dir, wanted):
        if _IGNORED.search(name):
            continue
        module_name, _, kind = name.removeprefix("model.").rpartition(".")
        if kind in ("weight_scale", "input_scale") or (kind == "weight" and tensor.dtype == torch.int8):
            quantized.setdefault(module_name, {})[kind] = tensor
            continue
        match = _LAYER_RE.match(name)
        if match:
            layer, proj, kind = match.groups()
            fused, index = FUSED_PROJECTIONS[proj]
            parts.setdefault(f"layers.{layer}.{fused}.{kind}", {})[index] = tensor
            continue
        state[name.removeprefix("model.")] = tensor
    for name, pieces in parts.items():
        expected = 3 if "qkv" in name else 2
        if len(pieces) != expected:
            raise ModelLoadError(f"{model_dir}: incomplete projection weights for {name}")
        state[name] = torch.cat([pieces[i] for i in range(expected)], dim=0)
    if "lm_head.weight" not in state and "lm_head" not in quantized and "embed_tokens.weight" in state:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    state = _stage_part(state, layers, config.num_layers)  # another stage's weights are its to check
    quantized = _stage_part(quantized, layers, config.num_layers)
    unexpected = sorted(set(state) - set(params))
    if unexpected:
        raise ModelLoadError(f"{model_dir}: unexpected weight {unexpected[0]!r} for {config.architecture}")
    if quantized and tp_world > 1:
        raise ConfigError(
            "tensor_parallel_size: INT8 checkpoints are served on one rank; quantize after sharding is not supported",
            field="tensor_parallel_size",
        )
    for module_name in quantized:
        params.pop(f"{module_name}.weight", None)
    if tp_world > 1:
        state = {
            name: shard_weight(name, tensor, config, tp_rank, tp_world) for name, tensor in state.items()
        }
    missing = sorted(set(params) - set(state))
    if missing:
        raise ModelLoadError(f"{model_dir}: missing weights {missing[:5]}{' …' if len(missing) > 5 else ''}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise ModelLoadError(
                f"{model_dir}: weight {name} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}"
            )
    compute_dtype = compute_dtype or dtype
    converted: dict[int, torch.Tensor] = {}  # tied weights stay one tensor
    for name in params:
        source = state[name]
        if id(source) not in converted:
            target = dtype if source.dim() >= 2 else compute_dtype
            converted[id(source)] = source.to(device=device, dtype=target).contiguous()
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        owner._parameters[attr] = torch.nn.Parameter(converted[id(source)], requires_grad=False)
    for module_name, tensors in quantized.items():
        linear = model.get_submodule(module_name)
        if not isinstance(linear, nn.Linear):
            raise ModelLoadError(f"{model_dir}: INT8 weights for {module_name}, which is not a linear layer")
        owner_name, _, attr = module_name.rpartition(".")
        int8 = Int8Linear(tensors["weight"], tensors["weight_scale"], linear.bias, tensors.get("input_scale"))
        setattr(model.get_submodule(owner_name) if owner_name else model, attr, int8.to(device))
    model.rotary = RotaryEmbedding(config.head_dim, config.rope, max_positions).to(device)
    model.compute_dtype = compute_dtype
    model.weight_dtype = dtype
    return model.requires_grad_(False).eval(), config

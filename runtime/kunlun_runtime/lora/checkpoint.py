"""Read a PEFT LoRA checkpoint into the base model's fused projections, or refuse it clearly.

A PEFT adapter is ``adapter_config.json`` (rank ``r``, ``lora_alpha``, ``use_rslora``,
``target_modules``, optional per-module ``rank_pattern``/``alpha_pattern``) and
``adapter_model.safetensors`` (or ``.bin``) with ``…layers.N.self_attn.q_proj.lora_A.weight``
[r, in] and ``lora_B.weight`` [out, r] per targeted projection. The engine fuses q/k/v and
gate/up (``models.loader``), so an adapter's projections are fused the same way: for a fused
projection of ``parts`` pieces, A becomes [parts, r, in] (each piece's A) and B [out, parts, r]
(each piece's B on its own rows: block-diagonal), with the scaling (``alpha / r``, rsLoRA
``alpha / sqrt(r)``) folded into B and zeros for the pieces the adapter leaves alone. Then one
shrink and one expand compute every piece's update at once, and tensor parallelism shards A and
B exactly as it shards the base weight (``lora.slots``).

Everything is checked before anything is kept: a file that is missing or unreadable, a PEFT
feature we do not serve (DoRA, LoRA biases, extra trainable modules, embeddings), a rank above
``max_lora_rank``, a module or shape that does not fit the base model (hidden size, layer count)
is an ``InvalidRequestError`` naming the adapter and the problem.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from kunlun_runtime.errors import InvalidRequestError
from kunlun_runtime.lora.request import LoRARequest
from kunlun_runtime.models.loader import FUSED_PROJECTIONS
from kunlun_runtime.models.model_config import ModelConfig

# HF projection → (our projection, its piece index): the loader's fused ones, and o and down alone.
PIECES = {
    **{name.rpartition(".")[2]: fused for name, fused in FUSED_PROJECTIONS.items()},
    "o_proj": ("self_attn.o_proj", 0),
    "down_proj": ("mlp.down_proj", 0),
}
NUM_PIECES = Counter(fused for fused, _ in PIECES.values())  # qkv 3, gate_up 2, o and down 1
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.\w+)?\.weight$")
# The module a PEFT key belongs to, as PEFT names it when it matches rank/alpha patterns.
_MODULE = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_[AB](?:\.\w+)?\.weight$")
_UNSUPPORTED = {  # adapter_config.json keys whose feature we do not serve, and what it is
    "use_dora": "DoRA",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D) weights",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "layer_replication": "layer replication",
    "lora_bias": "LoRA biases on B",
}


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    """An adapter read and checked against one base model, in the model's fused layout (FP32,
    full size: each rank shards it when it installs it)."""

    request: LoRARequest
    base: ModelConfig  # the whole model it was read for (what tensor parallelism shards by)
    rank: int  # the largest rank over its modules (what a slot must hold)
    # "layers.{i}.self_attn.qkv_proj" (checkpoint layer numbering) → (A [parts, rank, in], B [out, parts, rank])
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())

    def to(self, dtype: torch.dtype) -> LoRAAdapter:
        """The same adapter with its matrices in ``dtype`` (rounded once, as the slots would)."""
        weights = {name: (a.to(dtype), b.to(dtype)) for name, (a, b) in self.weights.items()}
        return LoRAAdapter(self.request, self.base, self.rank, weights)


def piece_shapes(config: ModelConfig) -> dict[str, tuple[int, list[int]]]:
    """Per fused projection: its input width and each piece's output height (the full model)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        "self_attn.qkv_proj": (hidden, [config.q_size, config.kv_size, config.kv_size]),
        "self_attn.o_proj": (config.q_size, [hidden]),
        "mlp.gate_up_proj": (hidden, [inter, inter]),
        "mlp.down_proj": (inter, [hidden]),
    }


def read_adapter(lora: LoRARequest, base: ModelConfig, max_lora_rank: int) -> LoRAAdapter:
    """Read ``lora``'s checkpoint for ``base``; raises InvalidRequestError naming the problem."""
    directory = Path(lora.lora_path)
    config = _read_config(lora, directory)
    _check_size(lora, directory, base, max_lora_rank)
    tensors = _read_tensors(lora, directory)
    shapes = piece_shapes(base)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    modules: dict[tuple[int, str], str] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None or match.group(2) not in PIECES:
            _refuse(lora, f"weight {key!r} is not a LoRA A/B of a q/k/v/o/gate/up/down projection")
        module = _MODULE.match(key)
        modules[int(match.group(1)), match.group(2)] = module.group("module") if module else key
        layer, proj, which = int(match.group(1)), match.group(2), match.group(3)
        if layer >= base.num_layers:
            _refuse(
                lora, f"weight {key!r} is for layer {layer}, but the base model has {base.num_layers} layers"
            )
        if tensor.dim() != 2:
            _refuse(lora, f"weight {key!r} has shape {tuple(tensor.shape)}, expected a matrix")
        found.setdefault((layer, proj), {})[which] = tensor
    if not found:
        _refuse(lora, "the checkpoint has no LoRA weights")
    ranks: dict[tuple[int, str], int] = {}
    for (layer, proj), pair in found.items():
        if set(pair) != {"A", "B"}:
            _refuse(lora, f"layers.{layer} {proj}: lora_{'B' if 'A' in pair else 'A'} is missing")
        fused, piece = PIECES[proj]
        in_features, outs = shapes[fused]
        rank = pair["A"].shape[0]
        expected_a, expected_b = (rank, in_features), (outs[piece], rank)
        if tuple(pair["A"].shape) != expected_a or tuple(pair["B"].shape) != expected_b:
            _refuse(
                lora,
                f"layers.{layer} {proj}: lora_A {tuple(pair['A'].shape)} and lora_B {tuple(pair['B'].shape)} "
                f"do not fit the base model (expected {expected_a} and {expected_b}: hidden size "
                f"{base.hidden_size}, intermediate size {base.intermediate_size}); is it an adapter of another model?",
            )
        if rank == 0:
            _refuse(lora, f"layers.{layer} {proj}: rank 0")
        if rank > max_lora_rank:
            _refuse(lora, f"rank {rank} ({proj}) is above --max-lora-rank {max_lora_rank}")
        ranks[(layer, proj)] = rank
    _check_layers(lora, config, found, base.num_layers)
    rank = max(ranks.values())
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, proj), pair in sorted(found.items()):
        fused, piece = PIECES[proj]
        name = f"layers.{layer}.{fused}"
        if name not in weights:
            in_features, outs = shapes[fused]
            parts = NUM_PIECES[fused]
            weights[name] = (torch.zeros(parts, rank, in_features), torch.zeros(sum(outs), parts, rank))
        a, b = weights[name]
        r = ranks[(layer, proj)]
        row = sum(shapes[fused][1][:piece])
        scale = _scaling(config, modules[(layer, proj)], r)
        a[piece, :r] = pair["A"].float()
        b[row : row + pair["B"].shape[0], piece, :r] = pair["B"].float() * scale
    return LoRAAdapter(lora, base, rank, weights)


def _scaling(config: dict[str, Any], module: str, rank: int) -> float:
    alpha = float(_by_pattern(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8)))
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _by_pattern(patterns: dict[str, Any], module: str, default: Any) -> Any:
    r"""PEFT's rule: the first pattern key that is a regex matching the module's whole name, or its
    end after a dot (``q_proj``, ``model.layers.3.self_attn.q_proj``, ``layers\.1\..*q_proj``).
    Ranks come from the tensors' shapes, so only alpha is looked up."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _check_layers(
    lora: LoRARequest,
    config: dict[str, Any],
    found: dict[tuple[int, str], dict[str, torch.Tensor]],
    num_layers: int,
) -> None:
    """Every targeted projection on every layer (or on exactly ``layers_to_transform``): an
    adapter of a shallower model with the same widths would otherwise apply to the first layers."""
    wanted = config.get("layers_to_transform")
    if isinstance(wanted, int):
        wanted = [wanted]
    expected = set(range(num_layers)) if wanted is None else {int(layer) for layer in wanted}
    for proj in sorted({proj for _, proj in found}):
        layers = {layer for layer, p in found if p == proj}
        if layers != expected:
            missing = sorted(expected - layers)
            _refuse(
                lora,
                f"{proj} has weights for {len(layers)} of the base model's {num_layers} layers "
                f"(missing layers {missing[:5]}{' …' if len(missing) > 5 else ''}); is it an adapter of another model?",
            )


def max_adapter_bytes(base: ModelConfig, max_lora_rank: int) -> int:
    """The largest checkpoint an adapter of rank ``max_lora_rank`` on every projection of ``base``
    can be, in FP32, with room for the file's header."""
    per_layer = sum(
        max_lora_rank * (in_features + out)
        for in_features, outs in piece_shapes(base).values()
        for out in outs
    )
    return 4 * per_layer * base.num_layers + (1 << 20)


def _check_size(lora: LoRARequest, directory: Path, base: ModelConfig, max_lora_rank: int) -> None:
    limit = max_adapter_bytes(base, max_lora_rank)
    for name in ("adapter_model.safetensors", "adapter_model.bin"):
        path = directory / name
        if path.is_file() and path.stat().st_size > limit:
            _refuse(
                lora,
                f"{name} is {path.stat().st_size / 2**20:.1f} MiB, more than an adapter of rank "
                f"{max_lora_rank} on every projection of this model can be ({limit / 2**20:.1f} MiB)",
            )


def _read_config(lora: LoRARequest, directory: Path) -> dict[str, Any]:
    path = directory / "adapter_config.json"
    if not path.is_file():
        _refuse(lora, f"{path} not found (a PEFT LoRA adapter directory has adapter_config.json)")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        _refuse(lora, f"{path}: not valid JSON ({error})")
    if not isinstance(config, dict):
        _refuse(lora, f"{path}: expected a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        _refuse(lora, f"peft_type {config.get('peft_type')!r}: only LORA adapters are served")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            _refuse(lora, f"{key}: {what} is not supported")
    if config.get("bias", "none") != "none":
        _refuse(lora, f"bias {config['bias']!r}: LoRA biases are not supported (train with bias='none')")
    if config.get("modules_to_save"):
        _refuse(
            lora, f"modules_to_save {config['modules_to_save']!r}: fully trained modules are not supported"
        )
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        _refuse(lora, f"lora_alpha: must be a positive number, got {alpha!r}")
    return config


def _read_tensors(lora: LoRARequest, directory: Path) -> dict[str, torch.Tensor]:
    safetensors, pickled = directory / "adapter_model.safetensors", directory / "adapter_model.bin"
    try:
        if safetensors.is_file():
            return load_file(str(safetensors))
        if pickled.is_file():
            loaded = torch.load(pickled, map_location="cpu", weights_only=True)
            if not isinstance(loaded, dict):
                _refuse(lora, f"{pickled}: expected a dict of tensors")
            return loaded
    except (SafetensorError, OSError, RuntimeError, ValueError) as error:
        _refuse(lora, f"cannot read the adapter's weights ({error})")
    _refuse(lora, f"{safetensors} not found (nor adapter_model.bin)")


def _refuse(lora: LoRARequest, problem: str) -> NoReturn:
    raise InvalidRequestError(
        f"lora adapter {lora.lora_name!r} ({lora.lora_path}): {problem}", field="lora_path"
    )

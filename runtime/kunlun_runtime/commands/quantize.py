"""Static INT8 quantization toolchain: calibrate on a text file, write a quantized checkpoint.

Every linear layer's weights become INT8 with one scale per output channel (``lm_head`` too, as
``--quantization int8`` does on the fly; it stays weight-only). The other layers' activations get a
static per-tensor scale (W8A8 on the INT8 matrix units) only where the
calibration set shows it accurate: the layer's output with quantized activations must stay within
``STATIC_MAX_REL_ERR`` of the unquantized output. Layers with outliers (e.g. the massive
activations of attention-sink tokens, where one static scale crushes every other token) stay
W8A16. The checkpoint's ``quantization.json`` records every layer's numbers and decision.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from kunlun_runtime.kv.cache import KVCache, KVCacheSpec
from kunlun_runtime.layers.linear import quantize_per_channel_int8
from kunlun_runtime.models.decoder import DecoderModel
from kunlun_runtime.models.forward import StepInputs, run_forward
from kunlun_runtime.models.tokenizer import Tokenizer

QUANT_METHOD = "kunlun-int8"
STATIC_MAX_REL_ERR = 0.01  # relative output error of W8A8 on the calibration set
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
)


@dataclass(frozen=True, slots=True)
class LayerCalibration:
    name: str
    absmax: float
    rel_err: float  # relative output error with the static activation scale (calibration set)
    static: bool  # True: W8A8 with a static per-tensor activation scale (absmax / 127)


def _run(model: DecoderModel, token_chunks: list[list[int]]) -> None:
    config = model.config
    dtype = model.weight_matrix.dtype
    for chunk in token_chunks:
        spec = KVCacheSpec.for_model(config, 16, dtype)
        num_blocks = -(-len(chunk) // 16)
        cache = KVCache(
            spec, num_blocks, torch.device("cpu"), cache_line_bytes=64, cache_num_sets=64, skew=False
        )
        inputs = StepInputs(
            chunk, list(range(len(chunk))), [len(chunk)], [len(chunk)], [list(range(num_blocks))]
        )
        run_forward(model, cache, inputs, torch.device("cpu"))


def _with_hooks(model: DecoderModel, token_chunks: list[list[int]], make_hook) -> None:
    handles = [
        module.register_forward_hook(make_hook(name))
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name != "lm_head"
    ]
    try:
        _run(model, token_chunks)
    finally:
        for handle in handles:
            handle.remove()


def calibrate(
    model: DecoderModel, token_chunks: list[list[int]], max_rel_err: float = STATIC_MAX_REL_ERR
) -> dict[str, LayerCalibration]:
    """Two passes over the chunks: the activation absmax at every linear input, then the output
    error that a static scale from it causes."""
    absmax: dict[str, float] = {}
    errors: dict[str, list[float]] = {}

    def record_absmax(name: str):
        def hook(_module, inputs, _output) -> None:
            absmax[name] = max(absmax.get(name, 0.0), float(inputs[0].detach().abs().max()))

        return hook

    def record_error(name: str):
        def hook(module, inputs, output) -> None:
            x = inputs[0].detach().float()
            scale = max(absmax[name], 1e-12) / 127.0
            xq = torch.clamp(torch.round(x / scale), -127, 127) * scale
            diff = torch.nn.functional.linear(xq, module.weight.float()) - output.detach().float()
            totals = errors.setdefault(name, [0.0, 0.0])
            totals[0] += float(diff.pow(2).sum())
            totals[1] += float(output.detach().float().pow(2).sum())

        return hook

    with torch.inference_mode():
        _with_hooks(model, token_chunks, record_absmax)
        _with_hooks(model, token_chunks, record_error)
    result = {}
    for name, (err, ref) in errors.items():
        rel = (err / max(ref, 1e-30)) ** 0.5
        result[name] = LayerCalibration(name, absmax[name], rel, static=rel <= max_rel_err)
    return result


def read_calibration_chunks(
    path: Path, tokenizer: Tokenizer, chunk_tokens: int = 256, max_chunks: int = 16
) -> list[list[int]]:
    ids = tokenizer.encode(path.read_text(), add_special_tokens=False)
    if not ids:
        raise ValueError(f"{path}: calibration file is empty")
    return [ids[i : i + chunk_tokens] for i in range(0, len(ids), chunk_tokens)][:max_chunks]


def write_quantized(
    model: DecoderModel, source_dir: Path, out_dir: Path, calibration: dict[str, LayerCalibration]
) -> Path:
    """Save ``model`` with INT8 linears (our fused names) next to the source's config and tokenizer;
    the embedding stays BF16."""
    tensors: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            q, scales = quantize_per_channel_int8(module.weight)
            tensors[f"{name}.weight"] = q
            tensors[f"{name}.weight_scale"] = scales
            if module.bias is not None:
                tensors[f"{name}.bias"] = module.bias.detach().to(torch.bfloat16)
            entry = calibration.get(name)
            if entry is not None and entry.static:
                tensors[f"{name}.input_scale"] = torch.tensor(max(entry.absmax, 1e-12) / 127.0)
    linear_names = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    for name, param in model.named_parameters():
        if name.rpartition(".")[0] not in linear_names:
            tensors[name] = param.detach().to(torch.bfloat16)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"))
    config = json.loads((source_dir / "config.json").read_text())
    config["tie_word_embeddings"] = False  # lm_head is stored on its own (INT8)
    config["quantization_config"] = {
        "quant_method": QUANT_METHOD,
        "weights": "int8, symmetric, per output channel",
        "activations": "int8, static per tensor where calibrated; dynamic per token elsewhere",
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for name in _TOKENIZER_FILES:
        if (source_dir / name).exists():
            shutil.copy(source_dir / name, out_dir / name)
    (out_dir / "quantization.json").write_text(
        json.dumps([asdict(v) for v in calibration.values()], indent=2)
    )
    return out_dir

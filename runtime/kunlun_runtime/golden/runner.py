"""Golden (numerical-equivalence) runs: the engine's paged path against HF ``transformers`` in FP32.

The same token ids go through both; forward hooks capture every layer's output (embedding, each
decoder layer, final norm, logits) and the report gives, per layer, the max absolute and relative
error, the tolerance and pass/fail, and names the first layer that diverges: a "harmless"
numerical substitution can show up only many layers later.

An engine that computes in FP32 over BF16 weights (CPUs without native BF16) is compared with the
reference over the same BF16-rounded weights, so the check stays an FP32 one: what differs is the
kernels' arithmetic, not the weights' rounding. Its KV cache may be BF16 (``--kv-cache-dtype``, the
default there): K/V rounded to BF16 are an approximation the reference does not make, held to a
bound of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kunlun_runtime.kv.cache import KVCache, KVCacheSpec
from kunlun_runtime.layers.attention import build_attention_metadata
from kunlun_runtime.layers.lora import LoRABatch
from kunlun_runtime.models.decoder import DecoderModel

# Tolerances on the relative error per layer (max over tokens of max |ours - reference| divided by
# that token's max |reference|), by engine dtype.
# FP32: the acceptance bound of the golden tests (1e-5). BF16/INT8: measured bounds (see README).
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 1e-1, torch.float16: 2e-2}
# FP32 activations over BF16 weights, against the reference over the same rounded weights: FP32
# arithmetic in another order (blocked dot products, online softmax) through 30 layers.
WIDENED_TOLERANCE = 1e-4
# FP32 activations over a BF16 KV cache: every key and value rounded to 8 bits of mantissa (relative
# 2**-9), through every layer; measured on the tiny models and SmolLM2 at about a third of this.
BF16_KV_TOLERANCE = 3e-2


@dataclass(frozen=True, slots=True)
class LayerError:
    name: str
    max_abs_err: float
    max_rel_err: float  # max over tokens of (max |error| / max |reference|) within the token
    tolerance: float
    passed: bool


@dataclass(frozen=True, slots=True)
class GoldenReport:
    model: str
    dtype: str
    num_tokens: int
    layers: tuple[LayerError, ...]
    first_divergent_layer: str | None
    passed: bool
    tensor_parallel_size: int = 1  # how many ranks each stage of the engine side was split into
    weight_dtype: str | None = None  # where the engine's weights are narrower than its activations
    pipeline_parallel_size: int = 1  # how many stages the engine side's layers were split into
    kv_cache_dtype: str | None = None  # where the engine's KV cache differs from its activations

    def to_dict(self) -> dict:
        return asdict(self)


def layer_names(num_layers: int) -> list[str]:
    return ["embed_tokens", *(f"layers.{i}" for i in range(num_layers)), "norm", "logits"]


def _hook_outputs(modules: dict[str, torch.nn.Module], store: dict[str, list[torch.Tensor]]) -> list:
    handles = []
    for name, module in modules.items():

        def hook(_module, _inputs, output, name=name) -> None:
            tensor = output[0] if isinstance(output, tuple) else output
            store.setdefault(name, []).append(tensor.detach().float().cpu().reshape(-1, tensor.shape[-1]))

        handles.append(module.register_forward_hook(hook))
    return handles


@torch.inference_mode()
def capture_engine(
    model: DecoderModel,
    token_ids: Sequence[int],
    block_size: int = 16,
    chunk_size: int | None = None,
    kv_cache_dtype: torch.dtype | None = None,
    lora_slot: int | None = None,
) -> dict[str, torch.Tensor]:
    """Run ``token_ids`` through the engine model's paged path (prefilled in chunks of
    ``chunk_size`` tokens if given) in a fresh KV cache of ``kv_cache_dtype`` (default: the
    activations'), on the LoRA adapter in ``lora_slot`` if given; return each layer's output [T, ...]."""
    config = model.config
    device = next(model.parameters()).device
    spec = KVCacheSpec.for_model(config, block_size, kv_cache_dtype or model.activation_dtype)
    num_blocks = -(-len(token_ids) // block_size)
    cache = KVCache(spec, num_blocks, device, cache_line_bytes=64, cache_num_sets=64, skew=True)
    # Reverse block order: the paged path must not depend on blocks being contiguous.
    table = list(reversed(range(num_blocks)))
    assert model.embed_tokens is not None and model.norm is not None, "a whole model (one pipeline stage)"
    modules: dict[str, torch.nn.Module] = {"embed_tokens": model.embed_tokens, "norm": model.norm}
    modules.update({f"layers.{i}": layer for i, layer in enumerate(model.layers)})
    store: dict[str, list[torch.Tensor]] = {}
    handles = _hook_outputs(modules, store)
    logits = []
    try:
        step = chunk_size or len(token_ids)
        for start in range(0, len(token_ids), step):
            chunk = list(token_ids[start : start + step])
            meta = build_attention_metadata([len(chunk)], [start + len(chunk)], [table], block_size, device)
            lora = None if lora_slot is None else LoRABatch.build([lora_slot], [len(chunk)], device)
            hidden = model(
                torch.tensor(chunk, device=device),
                torch.arange(start, start + len(chunk), device=device),
                cache,
                meta,
                lora=lora,
            )
            logits.append(model.compute_logits(hidden).cpu())
    finally:
        for handle in handles:
            handle.remove()
    # On the host, where the reference runs: the engine may be on an accelerator.
    captured = {name: torch.cat(parts).cpu() for name, parts in store.items()}
    captured["logits"] = torch.cat(logits)
    return captured


@torch.inference_mode()
def capture_reference(
    model_dir: Path,
    token_ids: Sequence[int],
    weight_dtype: torch.dtype | None = None,
    adapter_dir: Path | None = None,
) -> dict[str, torch.Tensor]:
    """The same layers from HF ``transformers`` in FP32 (eager attention); with ``weight_dtype``
    its matrices are first rounded to that dtype, as the engine keeps them; with ``adapter_dir``
    under that LoRA adapter, applied by PEFT (unmerged, as trained)."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    reference.eval()
    if weight_dtype is not None:
        for parameter in reference.parameters():
            if parameter.dim() >= 2:
                parameter.data = parameter.data.to(weight_dtype).float()
    if adapter_dir is not None:
        from peft import PeftModel  # a test dependency: golden runs of adapters only

        # PEFT wraps the projections of ``reference`` in place: calling it runs the adapter.
        PeftModel.from_pretrained(reference, str(adapter_dir)).eval()
    inner = reference.model
    modules = {"embed_tokens": inner.embed_tokens, "norm": inner.norm}
    modules.update({f"layers.{i}": layer for i, layer in enumerate(inner.layers)})
    store: dict[str, list[torch.Tensor]] = {}
    handles = _hook_outputs(modules, store)
    try:
        out = reference(torch.tensor([list(token_ids)]), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    captured = {name: parts[0] for name, parts in store.items()}
    captured["logits"] = out.logits[0].float()
    return captured


def compare(
    ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], names: list[str], tolerance: float
) -> tuple[LayerError, ...]:
    rows = []
    for name in names:
        delta = (ours[name] - reference[name]).abs()
        diff = delta.max().item()
        # Each token's error relative to that token's largest activation: models with massive
        # activations on a few tokens (attention sinks) must not hide errors on the others.
        row_scale = reference[name].abs().amax(dim=-1).clamp_min(1e-30)
        rel = (delta.amax(dim=-1) / row_scale).max().item()
        rows.append(LayerError(name, diff, rel, tolerance, bool(rel <= tolerance)))
    return tuple(rows)


def run_golden(
    model: DecoderModel,
    model_dir: Path,
    token_ids: Sequence[int],
    *,
    tolerance: float | None = None,
    block_size: int = 16,
    chunk_size: int | None = None,
    kv_cache_dtype: torch.dtype | None = None,
    lora: tuple[int, Path] | None = None,
) -> GoldenReport:
    """Compare ``model`` (the engine's, in its own dtype, over a KV cache of ``kv_cache_dtype``,
    default the same) with the FP32 reference on ``token_ids``; ``lora``: (the slot holding an
    adapter, its checkpoint directory), the reference running it through PEFT."""
    dtype, weight_dtype = model.activation_dtype, model.weight_matrix.dtype
    ours = capture_engine(
        model,
        token_ids,
        block_size=block_size,
        chunk_size=chunk_size,
        kv_cache_dtype=kv_cache_dtype,
        lora_slot=None if lora is None else lora[0],
    )
    return report_against_reference(
        ours,
        model_dir,
        token_ids,
        dtype,
        model.config.num_layers,
        tolerance,
        weight_dtype=None if weight_dtype == dtype else weight_dtype,
        kv_cache_dtype=None if kv_cache_dtype == dtype else kv_cache_dtype,
        adapter_dir=None if lora is None else lora[1],
    )


def default_tolerance(
    dtype: torch.dtype, weight_dtype: torch.dtype | None, kv_cache_dtype: torch.dtype | None
) -> float:
    """The bound of an engine computing in ``dtype`` over weights and a KV cache in the given
    dtypes (None: the same as ``dtype``)."""
    if dtype == torch.float32 and kv_cache_dtype == torch.bfloat16:
        return BF16_KV_TOLERANCE
    return WIDENED_TOLERANCE if weight_dtype is not None else TOLERANCES.get(dtype, 1e-2)


def report_against_reference(
    ours: dict[str, torch.Tensor],
    model_dir: Path,
    token_ids: Sequence[int],
    dtype: torch.dtype,
    num_layers: int,
    tolerance: float | None = None,
    tensor_parallel_size: int = 1,
    weight_dtype: torch.dtype | None = None,
    pipeline_parallel_size: int = 1,
    kv_cache_dtype: torch.dtype | None = None,
    adapter_dir: Path | None = None,
) -> GoldenReport:
    """Compare already captured engine layer outputs (from ``tensor_parallel_size`` ranks in each
    of ``pipeline_parallel_size`` stages) with the FP32 reference (over weights rounded to
    ``weight_dtype`` where the engine keeps them so; ``kv_cache_dtype``: the engine's KV cache,
    where it differs from ``dtype``)."""
    if tolerance is None:
        tolerance = default_tolerance(dtype, weight_dtype, kv_cache_dtype)
    names = layer_names(num_layers)
    reference = capture_reference(model_dir, token_ids, weight_dtype, adapter_dir)
    layers = compare(ours, reference, names, tolerance)
    first = next((layer.name for layer in layers if not layer.passed), None)
    return GoldenReport(
        model=str(model_dir),
        dtype=str(dtype).removeprefix("torch."),
        num_tokens=len(token_ids),
        layers=layers,
        first_divergent_layer=first,
        passed=first is None,
        tensor_parallel_size=tensor_parallel_size,
        weight_dtype=None if weight_dtype is None else str(weight_dtype).removeprefix("torch."),
        pipeline_parallel_size=pipeline_parallel_size,
        kv_cache_dtype=None if kv_cache_dtype is None else str(kv_cache_dtype).removeprefix("torch."),
    )


def format_report(report: GoldenReport) -> str:
    lines = [
        f"golden: {report.model} dtype={report.dtype}"
        + (f" weights={report.weight_dtype}" if report.weight_dtype else "")
        + (f" kv_cache={report.kv_cache_dtype}" if report.kv_cache_dtype else "")
        + f" tensor_parallel_size={report.tensor_parallel_size}"
        + f" pipeline_parallel_size={report.pipeline_parallel_size}"
        f" tokens={report.num_tokens} (reference: HF transformers FP32)",
        f"{'layer':<16}{'max_abs_err':>14}{'max_rel_err':>14}{'tolerance':>12}  result",
    ]
    for layer in report.layers:
        lines.append(
            f"{layer.name:<16}{layer.max_abs_err:>14.3e}{layer.max_rel_err:>14.3e}{layer.tolerance:>12.1e}  "
            f"{'pass' if layer.passed else 'FAIL'}"
        )
    verdict = "PASSED" if report.passed else f"FAILED: first divergent layer: {report.first_divergent_layer}"
    lines.append(verdict)
    return "\n".join(lines)

"""Linear layers in the backend's fastest weight format, converted once at load time.

- ``PackedLinear``: BF16 weights reordered into oneDNN's blocked layout (CPU), so each matmul
  streams the weight once without re-layout. oneDNN's BF16 path needs AVX-512 BW/VL/DQ (or
  AVX-NE-CONVERT); elsewhere ``prepacked`` is refused.
- ``NativeLinear``: the plain BF16 weight; batches of up to 64 rows (decode) go through our kernels
  (``cpu_kernels``: the AVX-512 tier for BF16 activations, the AVX2 tier for FP32 ones; they stream
  the weight near DRAM speed, which oneDNN's GEMM, built for large batches, falls well short of at
  one row), larger ones (prefill) through ``F.linear``, or ``widened_linear`` when the activations
  are FP32 or, from ``WIDE_FROM_ROWS`` rows, where the CPU's FP32 FMAs outrun its BF16 dot
  products (``kernel_choice.large_batch_dtype``).
- ``WideningLinear``: BF16 weight, FP32 activations, no kernels of ours (the plain floor of CPUs
  without native BF16): the weight is widened chunk by chunk into a small per-thread FP32
  workspace for oneDNN's SGEMM, so no FP32 copy of the model stays resident.
- ``Int8Linear``: weight-only INT8 with one scale per output channel. Small batches through our
  kernels where loaded; else ``torch._weight_int8pack_mm`` (BF16 activations, the fastest library
  decode matmul on AVX-512/AMX CPUs) or the weight dequantized into the workspace (FP32).

Module names are kept (``qkv_proj`` stays ``qkv_proj``), so golden runs hook the same layers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kunlun_runtime.layers import cpu_kernels
from kunlun_runtime.layers.kernel_choice import (
    choose_kernels,
    large_batches_in_fp32,
    require_native_backend,
    require_prepacked,
)
from kunlun_runtime.layers.kernel_choice import onednn_bf16_reason as onednn_bf16_reason  # re-exported

LINEAR_BACKENDS = frozenset({"plain", "prepacked", "native"})
# FP32 elements of the per-thread workspace that BF16/INT8 weights are widened into (16 MiB): a
# weight larger than that (a vocabulary projection) is widened and multiplied in row chunks.
WORKSPACE_ELEMENTS = 4 << 20
# From this many rows a native BF16 linear runs in FP32 where ``large_batches_in_fp32``: on a Xeon
# without AMX, oneDNN's SGEMM over the widened weight ran at 0.95x the BF16 GEMM's speed at 65 rows
# (the widening not yet paid for), 1.18x at 96, 1.5-1.6x at 512-2,048 (docs/performance.md).
WIDE_FROM_ROWS = 96
_KERNEL_DTYPES = (torch.bfloat16, torch.float32)


def choose_linear_backend(
    requested: str, dtype: torch.dtype, device: torch.device, weight_dtype: torch.dtype | None = None
) -> str:
    """Resolves ``auto`` for the compute ``dtype``, the ``weight_dtype`` (default: the same) and
    the device (``kernel_choice.choose_kernels``, the one place that decides): our kernels where
    the CPU tier runs them for this dtype, else oneDNN-prepacked BF16 weights where oneDNN's BF16
    path runs, else plain PyTorch (runs on any CPU).

    Raises ConfigError when an explicit ``native`` or ``prepacked`` cannot run here, naming the
    setting and what the CPU lacks.
    """
    return choose_kernels(requested, dtype, device, weight_dtype).backend


def _uses_small_batch_kernel(x: torch.Tensor, max_rows: int = cpu_kernels.MAX_ROWS) -> bool:
    return x.dim() == 2 and x.shape[0] <= max_rows and x.dtype in _KERNEL_DTYPES


class _Workspace(threading.local):
    buffer: torch.Tensor | None = None


_workspace = _Workspace()


def _workspace_rows(num_rows: int, row_elements: int) -> torch.Tensor:
    """A [num_rows, row_elements] FP32 view of this thread's workspace (grown on demand)."""
    needed = num_rows * row_elements
    if _workspace.buffer is None or _workspace.buffer.numel() < needed:
        with torch.inference_mode(False):  # usable in and outside inference mode alike
            _workspace.buffer = torch.empty(needed, dtype=torch.float32)
    return _workspace.buffer[:needed].view(num_rows, row_elements)


def widened_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(x, float(weight) [* scales], bias)`` for FP32 ``x`` and a BF16 or INT8 (with
    per-row ``scales``) ``weight``, widening at most ``WORKSPACE_ELEMENTS`` weight elements at a
    time into this thread's workspace."""
    num_out, num_in = weight.shape
    if torch.is_grad_enabled() and x.requires_grad:  # autograd keeps the widened weight: no reuse
        widened = weight.float() if scales is None else weight.float() * scales[:, None]
        return F.linear(x, widened, bias)
    rows = max(1, min(num_out, WORKSPACE_ELEMENTS // num_in))
    chunks = []
    for start in range(0, num_out, rows):
        stop = min(num_out, start + rows)
        widened = _workspace_rows(stop - start, num_in)
        widened.copy_(weight[start:stop])
        if scales is not None:
            widened.mul_(scales[start:stop, None])
        chunks.append(F.linear(x, widened, None if bias is None else bias[start:stop]))
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=-1)


def quantize_per_channel_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel INT8: returns (int8 weight [N, K], FP32 scales [N])."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    q = torch.clamp(torch.round(w / scales[:, None]), -127, 127).to(torch.int8)
    return q, scales


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
        self.bias = None if linear.bias is None else linear.bias.detach()  # the plain weight is dropped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class NativeLinear(nn.Module):
    bias_fp32: torch.Tensor | None  # buffer (register_buffer), None without a bias
    # Batches of up to this many rows go through our kernels (lowered only by benchmarks that
    # measure the earlier limit beside the current one).
    max_rows: int = cpu_kernels.MAX_ROWS
    # Batches of this many rows or more compute in FP32 where ``large_batches_in_fp32`` (None:
    # never, to time the BF16 GEMM beside it in one process).
    wide_from_rows: int | None = WIDE_FROM_ROWS

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Shared, not copied (a tied lm_head stays the embedding); the kernels need it contiguous.
        self.weight = (
            linear.weight
            if linear.weight.is_contiguous()
            else nn.Parameter(linear.weight.detach().contiguous(), requires_grad=False)
        )
        self.bias: torch.Tensor | None = linear.bias  # None for bias=False (typed Parameter by torch)
        self.register_buffer("bias_fp32", None if linear.bias is None else linear.bias.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _uses_small_batch_kernel(x, self.max_rows):
            return cpu_kernels.linear_bf16(x.contiguous(), self.weight, self.bias_fp32)
        if x.dtype != self.weight.dtype:
            return widened_linear(x, self.weight, self.bias_fp32)
        if self._wide(x):
            return widened_linear(x.float(), self.weight, self.bias_fp32).to(x.dtype)
        return F.linear(x, self.weight, self.bias)

    def _wide(self, x: torch.Tensor) -> bool:
        rows = x.numel() // max(self.in_features, 1)
        return self.wide_from_rows is not None and rows >= self.wide_from_rows and large_batches_in_fp32()


class WideningLinear(nn.Module):
    """BF16 weight, FP32 activations, plain PyTorch (see ``widened_linear``)."""

    bias_fp32: torch.Tensor | None  # buffer (register_buffer), None without a bias

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_buffer("bias_fp32", None if linear.bias is None else linear.bias.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return widened_linear(x, self.weight, self.bias_fp32)


class Int8Linear(nn.Module):
    """INT8 weights (per output channel). Without an activation scale (the default), small
    batches (decode) go through our kernels when ``native`` is on: the AVX-512 tier's W8A16 for
    BF16 activations, the AVX2 tier's W8A8 with dynamic activation scales for FP32 ones (for
    prefill as well); else
    ``_weight_int8pack_mm`` with BF16 activations. Larger batches multiply the weight
    dequantized to the activations' dtype. With a calibrated static ``input_scale`` (W8A8, where
    calibration showed it accurate), larger batches run on the INT8 matrix units via ``_int_mm``."""

    SMALL_BATCH = 4
    # Buffers (register_buffer); nn.Module.__getattr__ would type them ``Tensor | Module``.
    weight_int8: torch.Tensor
    scales: torch.Tensor
    scales_fp32: torch.Tensor
    bias: torch.Tensor | None
    input_scale: torch.Tensor | None

    def __init__(
        self,
        weight_int8: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        input_scale: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight_int8.shape
        self.register_buffer("weight_int8", weight_int8.contiguous())
        self.register_buffer("scales", scales.to(torch.bfloat16))
        self.register_buffer("scales_fp32", scales.float())
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.register_buffer("input_scale", None if input_scale is None else input_scale.float().reshape(()))
        self.native = False  # set by convert_linears for the ``native`` backend

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        q, scales = quantize_per_channel_int8(linear.weight.detach())
        return cls(q, scales, None if linear.bias is None else linear.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native and _uses_small_batch_kernel(x, cpu_kernels.INT8_MAX_ROWS):
            return cpu_kernels.linear_int8(x.contiguous(), self.weight_int8, self.scales_fp32, self.bias)
        if self.native and x.dtype == torch.float32 and x.dim() == 2 and self.input_scale is None:
            # Prefill too: the AVX2 tier's integer dot products outran oneDNN's SGEMM over the
            # widened weight at every prompt size tried (docs/performance.md).
            return cpu_kernels.linear_int8(x.contiguous(), self.weight_int8, self.scales_fp32, self.bias)
        if x.dtype == torch.float32 and (self.input_scale is None or x.shape[0] <= self.SMALL_BATCH):
            return widened_linear(x, self.weight_int8, self.bias, self.scales_fp32)
        if x.shape[0] <= self.SMALL_BATCH:
            out = torch._weight_int8pack_mm(x.to(torch.bfloat16), self.weight_int8, self.scales).float()
        elif self.input_scale is None:
            weight = (self.weight_int8.to(torch.bfloat16) * self.scales[:, None]).to(x.dtype)
            out = torch.nn.functional.linear(x, weight).float()
        else:
            xq = torch.clamp(torch.round(x.float() / self.input_scale), -127, 127).to(torch.int8)
            out = torch._int_mm(xq, self.weight_int8.t()).float() * (self.input_scale * self.scales_fp32)
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype)


def _replace(
    model: nn.Module, make: Callable[[nn.Linear], nn.Module], skip: frozenset[str] = frozenset()
) -> int:
    count = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and name not in skip:
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, attr, make(module))
            count += 1
    return count


def first_matrix(module: nn.Module) -> torch.Tensor:
    """The module's first parameter with two or more dimensions (a weight matrix, not a norm's
    vector), else its first parameter."""
    matrix = next((p for p in module.parameters() if p.dim() >= 2), None)
    return next(module.parameters()) if matrix is None else matrix


def convert_linears(
    model: nn.Module, *, backend: str, quantization: str | None, compute_dtype: torch.dtype | None = None
) -> int:
    """Convert the ``nn.Linear`` layers of ``model`` in place; returns how many were converted.

    ``quantization="int8"`` → Int8Linear (per output channel) for every linear, ``lm_head``
    included: once the layers are INT8 the vocabulary projection is a fifth of a decode step's
    bytes on SmolLM2, and quantizing it costs next to nothing in perplexity or greedy agreement
    (``benchmarks/bench_int8_quality.py`` measures it; see docs/performance.md). A tied
    ``lm_head`` gets its own INT8 copy; the embedding stays BF16. Then ``backend="native"`` →
    NativeLinear for every remaining BF16 linear, ``lm_head`` included, and our kernels for the
    INT8 ones; ``"prepacked"`` → PackedLinear for the remaining BF16 linears on CPU but
    ``lm_head``. Where the activations (``compute_dtype``, default: the weights' dtype) are FP32
    and the weights BF16, every linear not made native becomes a WideningLinear: ``"plain"`` then
    means plain PyTorch over widened weights.
    """
    count = 0
    if quantization == "int8":
        count += _replace(model, Int8Linear.from_linear)
    # ``embed_tokens`` is an nn.Embedding where a model has one (ours, HF's inner model; not a
    # later pipeline stage, whose first parameter is a norm's vector in the compute dtype).
    embed_tokens = getattr(model, "embed_tokens", None)
    weight: torch.Tensor = embed_tokens.weight if embed_tokens is not None else first_matrix(model)
    compute_dtype = compute_dtype or getattr(model, "compute_dtype", None) or weight.dtype
    if backend == "native":
        require_native_backend(compute_dtype)
        for module in model.modules():
            if isinstance(module, Int8Linear):
                module.native = True
        if weight.dtype == torch.bfloat16:
            count += _replace(model, NativeLinear)
    on_mkldnn = weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
    if backend == "prepacked" and weight.dtype == compute_dtype == torch.bfloat16 and on_mkldnn:
        require_prepacked(compute_dtype)
        # lm_head (wide: 49152 × 576 on SmolLM2) runs slower prepacked than plain BF16 at batch 1.
        count += _replace(model, PackedLinear, skip=frozenset({"lm_head"}))
    if weight.dtype == torch.bfloat16 and compute_dtype == torch.float32:
        count += _replace(model, WideningLinear)
    return count

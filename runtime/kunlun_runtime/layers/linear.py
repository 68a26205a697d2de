"""Linear layers in the backend's fastest weight format, converted once at load time.

- ``PackedLinear``: BF16 weights reordered into oneDNN's blocked layout (CPU), so each matmul
  streams the weight once without re-layout.
- ``NativeLinear``: the plain BF16 weight; batches of up to 16 rows (decode) go through our
  AVX-512 BF16 / AMX kernels (``cpu_kernels``: it streams the weight near DRAM speed, where oneDNN's GEMM
  reaches about a third of it at one row), larger ones (prefill) through ``F.linear``.
- ``Int8Linear``: weight-only INT8 with one scale per output channel, BF16 activations, through
  ``torch._weight_int8pack_mm`` (measured the fastest decode matmul on AVX-512/AMX CPUs); the
  weight is read at half the bytes of BF16, which is what decode at small batch is bound by.

Module names are kept (``qkv_proj`` stays ``qkv_proj``), so golden runs hook the same layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kunlun_runtime.errors import ConfigError
from kunlun_runtime.layers import cpu_kernels

LINEAR_BACKENDS = frozenset({"plain", "prepacked", "native"})


def choose_linear_backend(requested: str, dtype: torch.dtype, device: torch.device) -> str:
    """Resolves ``auto`` for this dtype and device: our native kernels for BF16 on CPUs that have
    them, else oneDNN-prepacked weights. An explicit ``native`` that cannot run says why."""
    if requested == "native":
        _require_native()
    if requested != "auto":
        return requested
    if device.type == "cpu" and dtype == torch.bfloat16 and cpu_kernels.load():
        return "native"
    return "prepacked"


def _require_native() -> None:
    if not cpu_kernels.load():
        raise ConfigError(
            f"linear_backend: native is unavailable here: {cpu_kernels.unavailable_reason()}",
            field="linear_backend",
        )


def _uses_small_batch_kernel(x: torch.Tensor, max_rows: int = cpu_kernels.MAX_ROWS) -> bool:
    return x.dim() == 2 and x.shape[0] <= max_rows and x.dtype == torch.bfloat16


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
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Shared, not copied (a tied lm_head stays the embedding); the kernels need it contiguous.
        self.weight = (
            linear.weight
            if linear.weight.is_contiguous()
            else nn.Parameter(linear.weight.detach().contiguous(), requires_grad=False)
        )
        self.bias = linear.bias
        self.register_buffer("bias_fp32", None if linear.bias is None else linear.bias.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _uses_small_batch_kernel(x):
            return cpu_kernels.linear_bf16(x.contiguous(), self.weight, self.bias_fp32)
        return F.linear(x, self.weight, self.bias)


class Int8Linear(nn.Module):
    """INT8 weights (per output channel). Without an activation scale (W8A16, the default):
    small batches (decode) go through our AVX-512 kernel when ``native`` is on (else
    ``_weight_int8pack_mm``) with BF16 activations, larger ones through the weight dequantized
    to BF16. With a calibrated static ``input_scale`` (W8A8, where
    calibration showed it accurate), larger batches run on the INT8 matrix units via ``_int_mm``."""

    SMALL_BATCH = 4

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


def _replace(model: nn.Module, make, skip: frozenset[str] = frozenset()) -> int:
    count = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and name not in skip:
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, attr, make(module))
            count += 1
    return count


def convert_linears(model: nn.Module, *, backend: str, quantization: str | None) -> int:
    """Convert the ``nn.Linear`` layers of ``model`` in place; returns how many were converted.

    ``quantization="int8"`` → Int8Linear (W8A16) for every linear, ``lm_head`` included: once the
    layers are INT8 the vocabulary projection is a fifth of a decode step's bytes on SmolLM2, and
    quantizing it measured +0.2 points of perplexity and no loss of greedy agreement
    (``benchmarks/bench_int8_quality.py``). A tied ``lm_head`` gets its own INT8 copy; the
    embedding stays BF16. Then ``backend="prepacked"`` → PackedLinear for the remaining BF16
    linears on CPU but ``lm_head``; ``"native"`` →
    NativeLinear for every remaining BF16 linear, ``lm_head`` included, and our kernel for the INT8
    ones; ``"plain"`` leaves them.
    """
    count = 0
    if quantization == "int8":
        count += _replace(model, Int8Linear.from_linear)
    weight = model.embed_tokens.weight if hasattr(model, "embed_tokens") else next(model.parameters())
    if backend == "native":
        _require_native()
        for module in model.modules():
            if isinstance(module, Int8Linear):
                module.native = True
        if weight.dtype == torch.bfloat16:
            count += _replace(model, NativeLinear)
    on_mkldnn = weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
    if backend == "prepacked" and weight.dtype == torch.bfloat16 and on_mkldnn:
        # lm_head (49152 × 576 on SmolLM2) measured slower prepacked than plain BF16 at batch 1.
        count += _replace(model, PackedLinear, skip=frozenset({"lm_head"}))
    return count

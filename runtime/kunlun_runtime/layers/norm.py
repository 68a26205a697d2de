"""RMSNorm, computed in FP32 and cast back exactly as the HF reference does (our CPU kernel when
``native`` is on, for the 2-D activations of the decoder layers in the kernels' dtype)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kunlun_runtime.layers import cpu_kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.native = False

    def uses_native(self, x: torch.Tensor) -> bool:
        return self.native and x.dim() == 2 and x.dtype == self.weight.dtype and x.is_contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.uses_native(x):
            return cpu_kernels.rms_norm(x, self.weight, self.eps)
        # One fused kernel in FP32 (the reference normalises in FP32 too), then the weight in the
        # input dtype, as HF does.
        h = F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=self.eps)
        return self.weight * h.to(x.dtype)

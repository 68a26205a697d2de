"""The skip for tests of our CPU kernel libraries, named once."""

from __future__ import annotations

import pytest
import torch

from kunlun_runtime.layers import cpu_kernels


def needs_kernels(activations: torch.dtype) -> pytest.MarkDecorator:
    """Skip, saying why, where the kernel tier that computes in ``activations`` (BF16: the AVX-512
    tier; FP32: the AVX2 tier) does not build or run on this machine. Asking builds the library
    the first time, as the tests then would."""
    reason = cpu_kernels.unavailable_reason(activations)
    return pytest.mark.skipif(reason is not None, reason=str(reason))

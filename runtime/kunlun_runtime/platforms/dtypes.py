"""What ``--dtype`` means on a platform: the compute (activation) dtype and the weights' dtype.

``auto`` is the platform's own choice (``Platform.default_dtype``, ``default_weight_dtype``); a
named dtype must be one the platform computes (``Platform.supported_dtypes``). The KV cache's dtype
is decided apart from these, in ``kv/kv_dtype.py``. This module only decides; it allocates nothing.
"""

from __future__ import annotations

import torch

from kunlun_runtime.errors import ConfigError
from kunlun_runtime.platforms.base import Platform

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def resolve_dtype(name: str, platform: Platform) -> torch.dtype:
    """The compute (activation) dtype of ``--dtype name`` on ``platform``.

    Raises ConfigError naming ``dtype`` when the platform does not support the named dtype.
    """
    if name == "auto":
        return platform.default_dtype()
    dtype = DTYPES[name]
    if dtype not in platform.supported_dtypes():
        raise ConfigError(f"dtype: {name} is not supported on {platform.name}", field="dtype")
    return dtype


def resolve_weight_dtype(name: str, platform: Platform) -> torch.dtype:
    """The dtype the weights are kept in: the platform's choice under ``auto``, else ``name``'s.

    Raises ConfigError naming ``dtype`` as ``resolve_dtype`` does.
    """
    return platform.default_weight_dtype() if name == "auto" else resolve_dtype(name, platform)

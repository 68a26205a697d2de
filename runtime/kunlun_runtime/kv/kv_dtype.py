"""What the paged KV cache stores: ``--kv-cache-dtype`` resolved against the activations and platform.

The KV cache dtype is its own choice, separate from the activations': on CPUs without native BF16
(the AVX2 tier and the plain floor) the activations are FP32, and an FP32 cache would hold half the
tokens a BF16 one holds in the same ``--kv-cache-memory``. A BF16 cache there stores K/V rounded
to nearest even and is widened to FP32 as attention reads it (layers/attention.py, the AVX2
kernels). This module only decides; it allocates nothing.
"""

from __future__ import annotations

import torch

from kunlun_runtime.errors import ConfigError
from kunlun_runtime.platforms import Platform

KV_CACHE_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def resolve_kv_cache_dtype(
    name: str, dtype: torch.dtype, platform: Platform, *, dtype_is_auto: bool = True
) -> torch.dtype:
    """The dtype the KV cache stores under ``--kv-cache-dtype name``, with activations of ``dtype``
    on ``platform``; ``dtype_is_auto``: ``dtype`` is the platform's choice (``--dtype auto``), not
    the user's.

    ``auto`` is the activation dtype (vLLM's meaning), except where the platform computes in FP32
    only because its BF16 arithmetic is emulated (a CPU under ``--dtype auto`` whose default is
    FP32: the AVX2 tier and the plain floor): there it is BF16. BF16 K/V halve the cache's bytes
    per token, so the same budget holds twice the tokens; and decode reads the cache from DRAM, so
    reading half the bytes outweighs widening them, more so the longer the context and the larger
    the batch (measured side by side: ``benchmarks/bench_kv_dtype.py``, docs/performance.md), on
    the AVX2 kernels and on the plain path alike; the accuracy given up is bounded and tested
    (``golden.BF16_KV_TOLERANCE``). An explicit ``--dtype float32`` keeps FP32 K/V: it asks for
    reference precision.

    Raises ConfigError naming ``kv_cache_dtype`` for an unknown name or a dtype the platform does
    not support.
    """
    if name == "auto":
        emulated_bf16 = (
            dtype_is_auto
            and dtype == torch.float32
            and platform.device_type == "cpu"
            and torch.bfloat16 in platform.supported_dtypes()
        )
        return torch.bfloat16 if emulated_bf16 else dtype
    if name not in KV_CACHE_DTYPES:
        raise ConfigError(
            f"kv_cache_dtype: must be one of {['auto', *sorted(KV_CACHE_DTYPES)]}, got {name!r}",
            field="kv_cache_dtype",
        )
    kv_dtype = KV_CACHE_DTYPES[name]
    if kv_dtype not in platform.supported_dtypes():
        raise ConfigError(
            f"kv_cache_dtype: {name} is not supported on {platform.name}", field="kv_cache_dtype"
        )
    return kv_dtype

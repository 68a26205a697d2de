"""KV cache tensors honour the block layout: aligned pool, skewed strides, payload views."""

import pytest
import torch

from kunlun_runtime.errors import ConfigError
from kunlun_runtime.kv.cache import KVCache, KVCacheSpec, plan_num_blocks

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)


def test_pool_rows_are_aligned_and_strided_as_the_layout_says():
    cache = KVCache(SPEC, 10, torch.device("cpu"), cache_line_bytes=64, cache_num_sets=64, skew=True)
    k = cache.k_blocks[0]
    assert k.shape == (10, 16, 2, 64)
    assert k.data_ptr() % 64 == 0
    assert k.stride(0) * 4 == cache.layout.stride_bytes == SPEC.block_bytes + 64
    k[3, 5] = 1.0  # writing one slot touches only that slot
    assert int((k != 0).sum()) == 2 * 64


def test_plan_num_blocks_counts_k_and_v_of_every_layer_with_padding():
    cache = KVCache(SPEC, 1, torch.device("meta"), cache_line_bytes=64, cache_num_sets=64, skew=True)
    per_block = 2 * 2 * cache.layout.stride_bytes
    assert plan_num_blocks(SPEC, cache.layout, per_block * 7 + 5, max_model_len=100) == 7


def test_budget_too_small_for_one_sequence_is_a_clear_error():
    cache = KVCache(SPEC, 1, torch.device("meta"), cache_line_bytes=64, cache_num_sets=64, skew=False)
    with pytest.raises(ConfigError, match="max_model_len=4096 needs 256") as error:
        plan_num_blocks(SPEC, cache.layout, 1 << 20, max_model_len=4096)
    assert error.value.field == "kv_cache_memory"

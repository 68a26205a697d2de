"""The plan every rank builds from (``plan_ranks``), and a node after the first running it.

Every node computes the same ``RankSpec`` from its own flags: the layout, each stage's layers and
shard, the dtypes, the linear backend and a KV cache of as many blocks as fit the budget; the
collective preflight checks that they agree (``RankSpec.agreement``). Node 0 runs the engine on
it; a node after the first (``serve_worker_node``) only follows the leader's steps. Planning
allocates nothing (the KV cache's layout is probed on the meta device) and starts no process.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from kunlun_runtime.config import DEFAULT_MASTER_PORT, EngineConfig
from kunlun_runtime.kv.cache import KVCache, KVCacheSpec, plan_num_blocks
from kunlun_runtime.kv.kv_dtype import resolve_kv_cache_dtype
from kunlun_runtime.layers.kernel_choice import choose_for_config
from kunlun_runtime.models.model_config import ModelConfig, load_model_config
from kunlun_runtime.models.model_dir import resolve_max_model_len, resolve_model_dir
from kunlun_runtime.models.sharding import shard_model_config
from kunlun_runtime.parallel.group import free_port
from kunlun_runtime.parallel.layout import ParallelLayout, stage_layers
from kunlun_runtime.parallel.workers import RankSpec, run_worker_node
from kunlun_runtime.platforms import Platform, detect
from kunlun_runtime.platforms.dtypes import resolve_dtype, resolve_weight_dtype


def plan_ranks(
    config: EngineConfig, platform: Platform, model_config: ModelConfig, model_dir: Path, max_model_len: int
) -> RankSpec:
    """What every rank builds: its stage and shard, and a KV cache of as many blocks as fit the
    budget on the rank with the most layers (every stage's cache has the same block count: the
    leader's scheduler hands out one block id for all of them). Every node computes it from its
    own flags; the preflight checks that they agree.

    Raises ConfigError naming the field: an unsupported dtype or KV cache dtype, a layout that
    does not fit (``ParallelLayout.validate``), a KV budget too small for one sequence.
    """
    dtype = resolve_dtype(config.dtype, platform)
    weight_dtype = resolve_weight_dtype(config.dtype, platform)
    kv_cache_dtype = resolve_kv_cache_dtype(
        config.kv_cache_dtype, dtype, platform, dtype_is_auto=config.dtype == "auto"
    )
    layout = ParallelLayout(
        config.tensor_parallel_size, config.pipeline_parallel_size, config.nnodes, config.node_rank
    ).validate()
    local_config = shard_model_config(model_config, layout.tensor) if layout.tensor > 1 else model_config
    stages = stage_layers(model_config, layout.pipeline)
    largest = replace(local_config, num_layers=max(len(stage) for stage in stages))
    spec = KVCacheSpec.for_model(largest, config.block_size, kv_cache_dtype)
    probe = KVCache(
        spec,
        1,
        torch.device("meta"),
        cache_line_bytes=platform.cache_line_bytes,
        cache_num_sets=platform.cache_num_sets,
        skew=config.kv_block_skew,
    )
    if config.master_port is not None:
        port = config.master_port
    else:
        port = free_port() if layout.nnodes == 1 and layout.world > 1 else DEFAULT_MASTER_PORT
    return RankSpec(
        model_dir=str(model_dir),
        dtype=dtype,
        weight_dtype=weight_dtype,
        kv_cache_dtype=kv_cache_dtype,
        max_positions=max_model_len,
        num_blocks=plan_num_blocks(spec, probe.layout, config.kv_cache_memory_bytes, max_model_len),
        block_size=config.block_size,
        cache_line_bytes=platform.cache_line_bytes,
        cache_num_sets=platform.cache_num_sets,
        kv_block_skew=config.kv_block_skew,
        linear_backend=choose_for_config(config, dtype, weight_dtype, platform.device()).backend,
        quantization=config.quantization,
        fused_attention=config.fused_attention,
        native_kernels=config.native_kernels,
        layout=layout,
        stages=tuple(stages),
        backend=platform.distributed_backend,
        master_addr=config.master_addr,
        master_port=port,
        platform=platform,
        timeout_seconds=config.distributed_timeout_seconds,
        leader_wait_seconds=config.leader_wait_timeout_seconds,
        require_native_kernels=config.require_native_kernels,
        vocab_size=model_config.vocab_size,
        hidden_size=model_config.hidden_size,
        lora_slots=(config.max_loras, config.max_lora_rank) if config.enable_lora else None,
    )


def serve_worker_node(config: EngineConfig) -> int:
    """Run a node after the first (``node_rank`` ≥ 1): its ranks follow the leader's steps until it
    stops them (0) or the group fails (1). It serves nothing itself.

    Raises ConfigError naming the field when the flags do not make a plan (see ``plan_ranks``).
    """
    config = config.validate()
    platform = detect(config.device)
    model_dir = resolve_model_dir(config.model)
    model_config = load_model_config(model_dir)
    spec = plan_ranks(config, platform, model_config, model_dir, resolve_max_model_len(config, model_config))
    return run_worker_node(spec)

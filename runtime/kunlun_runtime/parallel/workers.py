"""Tensor-parallel worker processes: ranks 1..N-1 run every step in lockstep with rank 0.

Rank 0 is the engine process: it schedules, samples and answers requests, and broadcasts each
step's inputs; the workers hold their weight and KV-cache shards and run the same forward, the
model's all-reduces joining the partial results. Every rank binds its own device first
(``Platform.set_device(rank)``: ranks are local, one node), before it joins the group or runs any
collective. Startup ends with the collective preflight on every rank, which also checks that rank
r is on device r; a worker that fails reports its rank and reason, and the engine refuses to start.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import queue
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from kunlun_runtime.errors import EngineDeadError
from kunlun_runtime.kv.cache import KVCache, KVCacheSpec
from kunlun_runtime.layers.linear import convert_linears
from kunlun_runtime.models.decoder import DecoderLayer, DecoderModel
from kunlun_runtime.models.forward import StepInputs, run_forward
from kunlun_runtime.models.loader import load_model
from kunlun_runtime.parallel.group import collective_preflight, free_port, init_group
from kunlun_runtime.platforms import Platform

logger = logging.getLogger(__name__)
READY_TIMEOUT_SECONDS = 300.0


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What every rank needs to build its shard (picklable, sent to the workers)."""

    model_dir: str
    dtype: torch.dtype  # activations and KV cache
    weight_dtype: torch.dtype
    max_positions: int
    num_blocks: int
    block_size: int
    cache_line_bytes: int
    cache_num_sets: int
    kv_block_skew: bool
    linear_backend: str
    quantization: str | None
    fused_attention: bool
    native_kernels: bool
    world: int
    backend: str
    port: int
    platform: Platform  # the engine's platform (pickled to the workers); binds each rank's device


def build_rank(spec: RankSpec, rank: int) -> tuple[DecoderModel, KVCache, torch.device]:
    """Load rank ``rank``'s model shard and allocate its KV cache."""
    device = spec.platform.device(rank)
    model, _ = load_model(
        Path(spec.model_dir),
        spec.weight_dtype,
        device,
        spec.max_positions,
        tp_rank=rank,
        tp_world=spec.world,
        compute_dtype=spec.dtype,
    )
    convert_linears(
        model, backend=spec.linear_backend, quantization=spec.quantization, compute_dtype=spec.dtype
    )
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)  # DecoderModel builds its layers so
        layer.self_attn.attn.fused = spec.fused_attention
    if spec.native_kernels:
        model.enable_native_kernels()
    cache_spec = KVCacheSpec.for_model(model.config, spec.block_size, spec.dtype)
    cache = KVCache(
        cache_spec,
        spec.num_blocks,
        device,
        cache_line_bytes=spec.cache_line_bytes,
        cache_num_sets=spec.cache_num_sets,
        skew=spec.kv_block_skew,
    )
    return model, cache, device


def threads_per_rank(world: int) -> int:
    return max(1, len(os.sched_getaffinity(0)) // world)


def worker_main(spec: RankSpec, rank: int, status: multiprocessing.Queue) -> None:
    """Entry point of worker ``rank``: join, load, preflight, then follow rank 0's steps."""
    torch.set_num_threads(threads_per_rank(spec.world))
    platform = spec.platform
    try:
        platform.set_device(rank)  # before any collective: NCCL/XCCL bind to the current device
        init_group(rank, spec.world, spec.port, spec.backend)
        model, cache, device = build_rank(spec, rank)
    except Exception as error:  # reported to rank 0 with the rank, never swallowed
        status.put((rank, f"{type(error).__name__}: {error}"))
        return
    status.put((rank, None))
    # rank 0 reports a failure
    collective_preflight(rank, spec.world, spec.backend, device, platform.current_device_index())
    while True:
        box: list[StepInputs | None] = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            break
        run_forward(model, cache, box[0], device)
    dist.destroy_process_group()


class TensorParallelGroup:
    """Rank 0's handle on the workers: start them, broadcast steps, stop them."""

    def __init__(self, spec: RankSpec) -> None:
        self.spec = spec
        context = multiprocessing.get_context("spawn")
        self._status = context.Queue()
        self._workers = [
            context.Process(
                target=worker_main, args=(spec, rank, self._status), daemon=True, name=f"tp-rank-{rank}"
            )
            for rank in range(1, spec.world)
        ]
        for worker in self._workers:
            worker.start()
        torch.set_num_threads(threads_per_rank(spec.world))
        spec.platform.set_device(0)
        init_group(0, spec.world, spec.port, spec.backend)
        self._closed = False
        atexit.register(self.close)

    @staticmethod
    def new_port() -> int:
        return free_port()

    def wait_ready(self, device: torch.device) -> None:
        """Wait until every worker has loaded its shard, then run the collective preflight.

        Raises EngineDeadError naming the failed rank (or the preflight's rank and backend)."""
        for _ in self._workers:
            try:
                rank, error = self._status.get(timeout=READY_TIMEOUT_SECONDS)
            except queue.Empty as timeout:
                self.close()
                raise EngineDeadError("tensor parallel: a worker did not report ready in time") from timeout
            if error is not None:
                self.close()
                raise EngineDeadError(f"tensor parallel: rank {rank} failed to start: {error}")
        collective_preflight(
            0, self.spec.world, self.spec.backend, device, self.spec.platform.current_device_index()
        )
        logger.info("tensor parallel: %d ranks ready (backend %s)", self.spec.world, self.spec.backend)

    def broadcast(self, inputs: StepInputs) -> None:
        dist.broadcast_object_list([inputs], src=0)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if dist.is_initialized():
            try:
                dist.broadcast_object_list([None], src=0)
            finally:
                for worker in self._workers:
                    worker.join(timeout=30)
                    if worker.is_alive():
                        worker.kill()
                dist.destroy_process_group()

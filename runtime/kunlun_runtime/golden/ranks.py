"""Golden runs split over ranks: tensor parallelism, pipeline stages, or both.

Every rank is a process that joins the group, loads its shard and passes the collective preflight
exactly as the engine's ranks do (``parallel.workers.join_and_load``), then runs the prompt as one
step through its stage (``StageRunner``: the real sends and receives at the stage boundaries, the
real return of the logits to rank 0). Tensor rank 0 of each stage captures its layers' outputs
(full hidden states, after the all-reduces) under their checkpoint names; together they are every
layer, for comparison with one rank or with the HF reference.
"""

from __future__ import annotations

import multiprocessing
import queue
from collections.abc import Sequence
from pathlib import Path

import torch

from kunlun_runtime.errors import EngineDeadError
from kunlun_runtime.golden.runner import _hook_outputs
from kunlun_runtime.models.forward import StepInputs
from kunlun_runtime.models.model_config import load_model_config
from kunlun_runtime.parallel.group import free_port
from kunlun_runtime.parallel.layout import ParallelLayout, stage_layers
from kunlun_runtime.parallel.pipeline import StepPlan, receive_logits
from kunlun_runtime.parallel.workers import RankSpec, join_and_load, threads_per_rank
from kunlun_runtime.platforms import CpuPlatform

BLOCK_SIZE = 16


def _rank_main(spec: RankSpec, rank: int, token_ids: list[int], results) -> None:
    torch.set_num_threads(threads_per_rank(spec.layout))
    try:
        runner, groups = join_and_load(spec, rank)
        model, layout = runner.model, spec.layout
        modules: dict[str, torch.nn.Module] = {
            f"layers.{model.first_layer + i}": layer for i, layer in enumerate(model.layers)
        }
        if model.embed_tokens is not None:
            modules["embed_tokens"] = model.embed_tokens
        if model.norm is not None:
            modules["norm"] = model.norm
        store: dict[str, list[torch.Tensor]] = {}
        handles = _hook_outputs(modules, store) if layout.tensor_rank_of(rank) == 0 else []
        # Reverse block order: the paged path must not depend on blocks being contiguous.
        table = list(reversed(range(spec.num_blocks)))
        inputs = StepInputs(
            list(token_ids), list(range(len(token_ids))), [len(token_ids)], [len(token_ids)], [table]
        )
        plan = StepPlan([inputs], [list(range(len(token_ids)))])
        logits = runner.run(plan)
        if rank == 0 and layout.pipeline > 1:
            logits = receive_logits(
                plan, spec.vocab_size, layout.last_stage_leader, groups.logits, runner.device, spec.dtype
            )
        for handle in handles:
            handle.remove()
        # numpy arrays: torch tensors would travel as shared-memory handles of an exiting process
        arrays = {name: torch.cat(parts).numpy() for name, parts in store.items()}
        if rank == 0:
            arrays["logits"] = torch.cat(logits).numpy()
        results.put((rank, arrays, None))
    except Exception as error:  # reported with the rank
        results.put((rank, None, f"{type(error).__name__}: {error}"))


def capture_parallel(
    model_dir: Path,
    token_ids: Sequence[int],
    tensor: int = 1,
    pipeline: int = 1,
    dtype: torch.dtype = torch.float32,
    weight_dtype: torch.dtype | None = None,
    kv_cache_dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Layer outputs of the model split ``tensor`` ways within each of ``pipeline`` stages (CPU,
    gloo, one process per rank), computing in ``dtype`` over weights in ``weight_dtype`` and a KV
    cache in ``kv_cache_dtype`` (default: both ``dtype``). Raises EngineDeadError naming the rank
    that failed."""
    config = load_model_config(model_dir)
    layout = ParallelLayout(tensor, pipeline).validate()
    spec = RankSpec(
        model_dir=str(model_dir),
        dtype=dtype,
        weight_dtype=weight_dtype or dtype,
        max_positions=len(token_ids) + 1,
        num_blocks=-(-len(token_ids) // BLOCK_SIZE),
        block_size=BLOCK_SIZE,
        cache_line_bytes=64,
        cache_num_sets=64,
        kv_block_skew=True,
        linear_backend="plain",  # widened where weights are narrower
        quantization=None,
        fused_attention=True,
        native_kernels=False,
        layout=layout,
        stages=tuple(stage_layers(config, pipeline)),
        backend="gloo",
        master_addr="127.0.0.1",
        master_port=free_port(),
        platform=CpuPlatform(),
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        kv_cache_dtype=kv_cache_dtype,
    )
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(target=_rank_main, args=(spec, rank, list(token_ids), results))
        for rank in range(layout.world)
    ]
    for process in processes:
        process.start()
    captured: dict[str, torch.Tensor] = {}
    errors = []
    try:
        for _ in processes:
            try:
                rank, data, error = results.get(timeout=300)
            except queue.Empty:
                errors.append("a rank did not report within 300 s")
                break
            if error:
                errors.append(f"rank {rank}: {error}")
            else:
                captured.update({name: torch.from_numpy(array) for name, array in data.items()})
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    if errors or "logits" not in captured:
        raise EngineDeadError("parallel golden run failed: " + "; ".join(errors or ["no logits came back"]))
    return captured


def capture_tensor_parallel(
    model_dir: Path,
    token_ids: Sequence[int],
    world: int,
    dtype: torch.dtype = torch.float32,
    weight_dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """``capture_parallel`` with tensor parallelism alone (``world`` ranks, one stage)."""
    return capture_parallel(model_dir, token_ids, world, 1, dtype, weight_dtype)

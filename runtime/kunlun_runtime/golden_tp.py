"""Golden runs under tensor parallelism: every rank runs the engine's paged path on its shard in
lockstep; rank 0's layer outputs (full hidden states, after the all-reduces) come back for
comparison with TP=1 or with the HF reference."""

from __future__ import annotations

import multiprocessing
from collections.abc import Sequence
from pathlib import Path

import torch

from kunlun_runtime.errors import EngineDeadError
from kunlun_runtime.golden import capture_engine
from kunlun_runtime.layers.linear import convert_linears
from kunlun_runtime.models.loader import load_model
from kunlun_runtime.parallel.group import collective_preflight, free_port, init_group
from kunlun_runtime.parallel.workers import threads_per_rank


def _rank_main(
    model_dir: str,
    dtypes: tuple[torch.dtype, torch.dtype],
    token_ids: list[int],
    world: int,
    port: int,
    rank: int,
    results,
) -> None:
    torch.set_num_threads(threads_per_rank(world))
    compute_dtype, weight_dtype = dtypes
    try:
        init_group(rank, world, port, "gloo")
        collective_preflight(rank, world, "gloo", torch.device("cpu"))
        model, _ = load_model(
            Path(model_dir),
            weight_dtype,
            torch.device("cpu"),
            len(token_ids) + 1,
            tp_rank=rank,
            tp_world=world,
            compute_dtype=compute_dtype,
        )
        convert_linears(model, backend="plain", quantization=None)  # widened where weights are narrower
        captured = capture_engine(model, token_ids)
        # numpy arrays: torch tensors would travel as shared-memory handles of an exiting process
        arrays = {name: t.numpy() for name, t in captured.items()} if rank == 0 else None
        results.put((rank, arrays, None))
    except Exception as error:  # reported with the rank
        results.put((rank, None, f"{type(error).__name__}: {error}"))


def capture_tensor_parallel(
    model_dir: Path,
    token_ids: Sequence[int],
    world: int,
    dtype: torch.dtype = torch.float32,
    weight_dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Layer outputs of the model split ``world`` ways (CPU, gloo), computing in ``dtype`` over
    weights in ``weight_dtype`` (default: the same). Raises EngineDeadError naming the rank that
    failed."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(
            target=_rank_main,
            args=(
                str(model_dir),
                (dtype, weight_dtype or dtype),
                list(token_ids),
                world,
                port,
                rank,
                results,
            ),
        )
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    captured, errors = None, []
    try:
        for _ in processes:
            rank, data, error = results.get(timeout=300)
            if error:
                errors.append(f"rank {rank}: {error}")
            if rank == 0:
                captured = data
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    if errors or captured is None:
        raise EngineDeadError("tensor parallel golden run failed: " + "; ".join(errors))
    return {name: torch.from_numpy(array) for name, array in captured.items()}

"""The tensor-parallel process group and its collective preflight.

Before a TP engine reports ready, every rank all-reduces a tensor of known values; a wrong sum or
a failing collective names the rank and backend (a known Kunlun pain: XCCL errors at TP=2 that
otherwise surface as wrong tokens or a hang mid-request). Every rank also reports the device it is
bound to (``Platform.set_device``): rank r must be on device r (its local rank), else two ranks
share a card and the preflight names the rank.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from kunlun_runtime.errors import EngineDeadError

INIT_TIMEOUT = timedelta(seconds=120)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_group(rank: int, world: int, port: int, backend: str) -> None:
    """Join the group of ``world`` ranks rendezvousing on 127.0.0.1:``port``."""
    try:
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=INIT_TIMEOUT
        )
    except Exception as error:  # any backend failure here is fatal and must be named
        raise EngineDeadError(
            f"tensor parallel: rank {rank} could not join the {backend} group: {error}"
        ) from error


def collective_preflight(
    rank: int, world: int, backend: str, device: torch.device, device_index: int | None = None
) -> None:
    """All-reduce known values on every rank and gather each rank's bound device index
    (``device_index``, None where the platform binds none); raise EngineDeadError naming the rank
    and backend if a sum is wrong or a rank is not on its own device."""
    values = torch.full((4,), float(rank + 1), device=device)
    try:
        dist.all_reduce(values)
    except Exception as error:
        raise EngineDeadError(
            f"tensor parallel preflight: all-reduce failed on rank {rank} of {world} (backend {backend}): {error}"
        ) from error
    expected = world * (world + 1) / 2
    if not torch.all(values == expected):
        raise EngineDeadError(
            f"tensor parallel preflight: rank {rank} of {world} (backend {backend}) got {values.tolist()}, "
            f"expected {expected} everywhere"
        )
    reported: list[int | None] = [None] * world
    try:
        dist.all_gather_object(reported, device_index)
    except Exception as error:
        raise EngineDeadError(
            f"tensor parallel preflight: gathering the ranks' devices failed on rank {rank} of {world} "
            f"(backend {backend}): {error}"
        ) from error
    check_device_binding(reported, backend)


def check_device_binding(reported: Sequence[int | None], backend: str) -> None:
    """Rank r must report device r; all None (a platform without devices, the CPU) passes.

    Raises:
        EngineDeadError: naming the first rank on another device, or without one while others have one.
    """
    if all(index is None for index in reported):
        return
    for rank, index in enumerate(reported):
        if index != rank:
            where = "no device" if index is None else f"device {index}"
            raise EngineDeadError(
                f"tensor parallel preflight: rank {rank} of {len(reported)} (backend {backend}) is bound "
                f"to {where}, expected device {rank} (its local rank); devices by rank: {list(reported)}"
            )


def all_reduce_(tensor: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(tensor)
    return tensor

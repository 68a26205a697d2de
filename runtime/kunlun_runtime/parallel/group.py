"""The process group of all ranks, its subgroups, and the collective preflight.

Every rank joins one torch.distributed group over TCP at the leader's address (``init_group``),
then makes the groups it serves with: all ranks with the step timeout (``--distributed-timeout``:
a rank that dies or stops answering fails the next collective within that bound instead of
hanging it), and each stage's tensor-parallel ranks. Joining and loading use the much longer
startup timeout: nodes start and load at their own pace.

Before the leader reports ready every rank runs the collective preflight
(``collective_preflight``): each rank's load result and bound device are gathered, the whole
group and each stage all-reduce known values, and every stage boundary (and the way back to the
leader) carries a known tensor. A failure names the rank, its node and host, and the backend (a
known Kunlun pain: XCCL errors that otherwise surface as wrong tokens or a hang mid-request).
Rank r must be bound to its local device (``Platform.set_device``), else two ranks share a card.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from kunlun_runtime.errors import EngineDeadError
from kunlun_runtime.parallel.layout import ParallelLayout

# NCCL (and XCCL behind the same name on Kunlun) report a collective timeout by aborting the
# process from their watchdog unless waits block: then the wait raises, as gloo's does, and the
# leader can end its streams with an error and exit 1 instead of dying mid-write.
BLOCKING_WAIT_ENV = {"TORCH_NCCL_BLOCKING_WAIT": "1"}
STARTUP_TIMEOUT = timedelta(minutes=30)  # joining (nodes start when they are scheduled) and loading
DEFAULT_TIMEOUT_SECONDS = 60.0  # every collective while serving
logger = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True, slots=True)
class RankGroups:
    """The groups one rank communicates over once loaded."""

    serving: ProcessGroup  # all ranks, with the step timeout
    tensor: ProcessGroup | None  # this rank's stage; None without tensor parallelism
    # The leader and the last stage's first rank, for the logits coming back: a communicator of
    # their own, so that on NCCL/XCCL (one stream per communicator) the returning logits never
    # queue behind the hidden states the leader sends on. None elsewhere and with one stage.
    logits: ProcessGroup | None = None


def init_group(
    layout: ParallelLayout,
    rank: int,
    backend: str,
    master_addr: str,
    master_port: int,
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
) -> RankGroups:
    """Join the group of all ranks at ``master_addr:master_port`` (rank 0 listens there) and
    make the serving subgroups. Raises EngineDeadError naming the rank, node and backend."""
    where = f"rank {rank} (node {layout.node_of(rank)}, backend {backend})"
    if backend == "nccl":
        for name, value in BLOCKING_WAIT_ENV.items():
            os.environ.setdefault(name, value)
    if rank == 0 and layout.nnodes > 1:  # the join below waits for every node without a word
        logger.info(
            "rank 0: waiting for the %d ranks of %d nodes to join at port %d (up to %.0f min)",
            layout.world,
            layout.nnodes,
            master_port,
            STARTUP_TIMEOUT.total_seconds() / 60,
        )
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=layout.world,
            timeout=STARTUP_TIMEOUT,
        )
        timeout = timedelta(seconds=timeout_seconds)
        serving = dist.new_group(list(range(layout.world)), timeout=timeout)
        tensor = serving if layout.pipeline == 1 and layout.tensor > 1 else None  # one stage: all ranks
        logits = None
        if layout.pipeline > 1:  # every rank makes every group, in the same order
            for stage in range(layout.pipeline):
                group = dist.new_group(list(layout.stage_ranks(stage)), timeout=timeout)
                if stage == layout.stage_of(rank) and layout.tensor > 1:
                    tensor = group
            returning = dist.new_group([0, layout.last_stage_leader], timeout=timeout)
            logits = returning if rank in (0, layout.last_stage_leader) else None
    except Exception as error:  # any backend failure here is fatal and must be named
        raise EngineDeadError(
            f"parallel group: {where} could not join the group at {master_addr}:{master_port}: {error}"
        ) from error
    return RankGroups(serving, tensor, logits)


@dataclass(frozen=True, slots=True)
class RankReport:
    """What every rank tells the others at the preflight."""

    host: str
    load_error: str | None
    device_index: int | None
    agreement: tuple = ()  # what every rank must have planned alike (the leader's is the truth)


def collective_preflight(
    layout: ParallelLayout,
    rank: int,
    groups: RankGroups,
    backend: str,
    device: torch.device,
    device_index: int | None = None,
    load_error: str | None = None,
    agreement: tuple = (),
) -> None:
    """Run on every rank once it has loaded (or failed to: ``load_error``); raise
    EngineDeadError on every rank, naming the first rank that failed."""
    reports: list[RankReport | None] = [None] * layout.world
    own = RankReport(socket.gethostname(), load_error, device_index, agreement)
    try:
        dist.all_gather_object(reports, own)  # the startup group: waits for the slowest load
    except Exception as error:
        raise EngineDeadError(
            f"collective preflight: gathering the ranks' reports failed on {_name(layout, rank, own.host)} "
            f"(backend {backend}): {error}"
        ) from error
    complete = [report or RankReport("?", "no report", None) for report in reports]
    for other, report in enumerate(complete):
        if report.load_error is not None:
            raise EngineDeadError(
                f"collective preflight: {_name(layout, other, report.host)} failed to start: {report.load_error}"
            )
        if report.agreement != complete[0].agreement:
            raise EngineDeadError(
                f"collective preflight: {_name(layout, other, report.host)} planned {report.agreement}, "
                f"the leader {complete[0].agreement} (tensor, pipeline, nodes, dtype, weight dtype, "
                "positions, KV blocks, block size, quantization, stages, vocabulary, hidden size): "
                "start every node with the same model and engine flags"
            )
    check_device_binding([report.device_index for report in complete], backend, layout)
    hosts = [report.host for report in complete]
    _check_sum(layout, rank, hosts, backend, device, groups.serving, range(layout.world), "all ranks")
    if groups.tensor is not None:
        stage = layout.stage_of(rank)
        ranks = layout.stage_ranks(stage)
        _check_sum(layout, rank, hosts, backend, device, groups.tensor, ranks, f"stage {stage}")
    problem = _check_boundaries(layout, rank, hosts, backend, device, groups)
    problems: list[str | None] = [None] * layout.world
    dist.all_gather_object(problems, problem, group=groups.serving)
    first = next((p for p in problems if p is not None), None)
    if first is not None:
        raise EngineDeadError(f"collective preflight: {first}")


def _name(layout: ParallelLayout, rank: int, host: str) -> str:
    return f"rank {rank} of {layout.world} (node {layout.node_of(rank)}, host {host})"


def _check_sum(
    layout: ParallelLayout,
    rank: int,
    hosts: Sequence[str],
    backend: str,
    device: torch.device,
    group: ProcessGroup,
    ranks: range,
    what: str,
) -> None:
    values = torch.full((4,), float(rank + 1), device=device)
    try:
        dist.all_reduce(values, group=group)
    except Exception as error:
        raise EngineDeadError(
            f"collective preflight: all-reduce over {what} failed on {_name(layout, rank, hosts[rank])} "
            f"(backend {backend}): {error}"
        ) from error
    expected = float(sum(r + 1 for r in ranks))
    if not torch.all(values == expected):
        raise EngineDeadError(
            f"collective preflight: all-reduce over {what} on {_name(layout, rank, hosts[rank])} "
            f"(backend {backend}) got {values.tolist()}, expected {expected} everywhere"
        )


def _check_boundaries(
    layout: ParallelLayout,
    rank: int,
    hosts: Sequence[str],
    backend: str,
    device: torch.device,
    groups: RankGroups,
) -> str | None:
    """Send a known tensor across every stage boundary this rank is on, and from the last stage
    back to the leader (over their own group); returns what went wrong on this rank, or None."""
    if layout.pipeline == 1:
        return None
    stage = layout.stage_of(rank)
    links: list[tuple[str, int, int, ProcessGroup | None]] = []  # (direction, peer, tag, group)
    if stage > 0:
        links.append(("recv", layout.previous_rank(rank), 0, groups.serving))
    if stage < layout.pipeline - 1:
        links.append(("send", layout.next_rank(rank), 0, groups.serving))
    if rank == layout.last_stage_leader:
        links.append(("send", 0, 1, groups.logits))
    if rank == 0:
        links.append(("recv", layout.last_stage_leader, 1, groups.logits))
    pending = []
    try:
        for direction, peer, tag, group in links:  # sends first, without waiting: no rank waits in turn
            if direction == "send":
                payload = torch.arange(8, dtype=torch.float32, device=device) + 1000 * rank + tag
                work = dist.isend(payload, dst=peer, group=group, tag=tag)
                pending.append((work, payload))
        for direction, peer, tag, group in links:
            if direction == "recv":
                received = torch.empty(8, dtype=torch.float32, device=device)
                dist.recv(received, src=peer, group=group, tag=tag)
                expected = torch.arange(8, dtype=torch.float32, device=device) + 1000 * peer + tag
                if not torch.equal(received, expected):
                    return (
                        f"{_name(layout, rank, hosts[rank])} received {received.tolist()} from "
                        f"{_name(layout, peer, hosts[peer])} across a stage boundary (backend {backend}), "
                        f"expected {expected.tolist()}"
                    )
        for work, _ in pending:
            if work is not None:
                work.wait()
    except Exception as error:
        return f"a stage boundary failed on {_name(layout, rank, hosts[rank])} (backend {backend}): {error}"
    return None


def check_device_binding(
    reported: Sequence[int | None], backend: str, layout: ParallelLayout | None = None
) -> None:
    """Rank r must report its local device (r itself on one node); all None (a platform without
    devices, the CPU) passes.

    Raises:
        EngineDeadError: naming the first rank on another device, or without one while others have one.
    """
    if all(index is None for index in reported):
        return
    layout = layout or ParallelLayout(tensor=len(reported))
    for rank, index in enumerate(reported):
        local = layout.local_rank_of(rank)
        if index != local:
            where = "no device" if index is None else f"device {index}"
            raise EngineDeadError(
                f"collective preflight: rank {rank} of {len(reported)} (node {layout.node_of(rank)}, "
                f"backend {backend}) is bound to {where}, expected device {local} (its local rank); "
                f"devices by rank: {list(reported)}"
            )

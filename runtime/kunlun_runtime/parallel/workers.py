"""The ranks' processes: what each builds, how the others follow the leader, and the leader's handle.

Rank 0 is the engine process: it schedules, samples and answers requests, and sends each step's
plan to every other rank (``LeaderGroup.execute``); the others (``follow_leader``) hold their
stage's weight and KV-cache shards and run their part of every step (``StageRunner``). A node's
first rank is the process the node was started as; it starts the node's other ranks as local
worker processes (``spawn``). Every rank binds its local device first
(``Platform.set_device``), before it joins the group or runs any collective, and startup ends
with the collective preflight on every rank.

While the engine is idle the leader sends a keepalive round (a broadcast and a barrier) every
third of the collective timeout: the others, waiting for the next step, see a live leader, and
the leader sees a dead or silent rank within the timeout even when no request comes, and
reports it (``on_failure``) so the server can fail its health and exit. A rank that loses the
leader fails its next collective within the timeout and exits 1.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from kunlun_runtime.errors import ConfigError, EngineDeadError
from kunlun_runtime.kv.cache import KVCache, KVCacheSpec
from kunlun_runtime.layers import cpu_kernels
from kunlun_runtime.layers.attention_backend import kernels_read_cache
from kunlun_runtime.layers.linear import convert_linears
from kunlun_runtime.lora.checkpoint import LoRAAdapter
from kunlun_runtime.lora.slots import enable_lora_slots, install_adapter
from kunlun_runtime.models.decoder import DecoderLayer, DecoderModel
from kunlun_runtime.models.loader import load_model
from kunlun_runtime.parallel.group import (
    DEFAULT_TIMEOUT_SECONDS,
    STARTUP_TIMEOUT,
    RankGroups,
    collective_preflight,
    init_group,
)
from kunlun_runtime.parallel.layout import ParallelLayout
from kunlun_runtime.parallel.pipeline import StageRunner, StepPlan, receive_logits
from kunlun_runtime.parallel.rendezvous import wait_for_leader
from kunlun_runtime.platforms import Platform

logger = logging.getLogger(__name__)
KEEPALIVE = "keepalive"  # the message of an idle leader's keepalive round


@dataclass(frozen=True, slots=True)
class InstallLoRA:
    """The leader's message: every rank puts its share of ``adapter`` in ``slot`` (None: empties it)."""

    slot: int
    adapter: LoRAAdapter | None


POLL_SECONDS = 0.2  # how often the leader checks its local workers while the group starts
EXIT_GRACE_SECONDS = 5.0  # after a local worker exits, how long the preflight has to say why


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What every rank needs to build its shard (picklable, sent to the local workers)."""

    model_dir: str
    dtype: torch.dtype  # activations (and the KV cache, unless kv_cache_dtype says otherwise)
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
    layout: ParallelLayout
    stages: tuple[range, ...]  # the layers of each pipeline stage
    backend: str
    master_addr: str
    master_port: int
    platform: Platform  # the engine's platform (pickled to the workers); binds each rank's device
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    leader_wait_seconds: float | None = None  # a worker node's wait for the leader; None: timeout_seconds
    require_native_kernels: bool = False  # a rank whose process cannot load our kernels fails
    vocab_size: int = 0  # of the logits the last stage returns
    hidden_size: int = 0
    kv_cache_dtype: torch.dtype | None = None  # what the KV cache stores; None: the activations' dtype
    lora_slots: tuple[int, int] | None = None  # (max_loras, max_lora_rank) where LoRA is enabled

    @property
    def cache_dtype(self) -> torch.dtype:
        """The dtype every rank's KV cache stores."""
        return self.kv_cache_dtype or self.dtype

    def agreement(self) -> tuple:
        """What every node must have computed alike (nodes plan independently, from their own
        flags): a node started with other flags would build a different model or cache."""
        return (
            self.layout.tensor,
            self.layout.pipeline,
            self.layout.nnodes,
            str(self.dtype),
            str(self.weight_dtype),
            str(self.cache_dtype),
            self.max_positions,
            self.num_blocks,
            self.block_size,
            self.quantization,
            tuple((stage.start, stage.stop) for stage in self.stages),
            self.vocab_size,
            self.hidden_size,
            self.lora_slots,
        )


def build_rank(spec: RankSpec, rank: int) -> tuple[DecoderModel, KVCache, torch.device]:
    """Load rank ``rank``'s shard (its stage's layers, its tensor-parallel part of them) and
    allocate its KV cache (its stage's layers only)."""
    layout = spec.layout
    device = spec.platform.device(layout.local_rank_of(rank))
    model, _ = load_model(
        Path(spec.model_dir),
        spec.weight_dtype,
        device,
        spec.max_positions,
        tp_rank=layout.tensor_rank_of(rank),
        tp_world=layout.tensor,
        compute_dtype=spec.dtype,
        layers=spec.stages[layout.stage_of(rank)],
    )
    convert_linears(
        model, backend=spec.linear_backend, quantization=spec.quantization, compute_dtype=spec.dtype
    )
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)  # DecoderModel builds its layers so
        layer.self_attn.attn.fused = spec.fused_attention
    native = spec.native_kernels and model.enable_native_kernels()
    if spec.native_kernels and not native and device.type == "cpu":
        # The node's start line reports the kernels its main process loaded; a rank in another
        # process that could not load them must say so itself, or it runs slower in silence.
        reason = cpu_kernels.unavailable_reason(spec.dtype)
        if reason is not None and spec.require_native_kernels:
            raise ConfigError(
                f"require_native_kernels: rank {rank}'s process could not load our CPU kernels: {reason}",
                field="require_native_kernels",
            )
        if reason is not None:
            logger.warning(
                "rank %d: our CPU kernels did not load in this process; its layers run on plain "
                "PyTorch (slower decode): %s",
                rank,
                reason,
            )
    if native and not kernels_read_cache(spec.dtype, spec.cache_dtype):
        logger.warning(
            "no kernel reads a %s KV cache under %s activations: attention runs the plain PyTorch path "
            "(slower decode); --kv-cache-dtype auto picks a pairing the kernels read",
            spec.cache_dtype,
            spec.dtype,
        )
    if spec.lora_slots is not None:
        enable_lora_slots(model, *spec.lora_slots)
    cache_spec = KVCacheSpec.for_model(model.config, spec.block_size, spec.cache_dtype)
    cache = KVCache(
        cache_spec,
        spec.num_blocks,
        device,
        cache_line_bytes=spec.cache_line_bytes,
        cache_num_sets=spec.cache_num_sets,
        skew=spec.kv_block_skew,
    )
    return model, cache, device


def threads_per_rank(layout: ParallelLayout) -> int:
    """The node's CPUs shared by its ranks, or fewer where ``OMP_NUM_THREADS`` says so (several
    "nodes" on one machine)."""
    share = max(1, len(os.sched_getaffinity(0)) // layout.ranks_per_node)
    configured = os.environ.get("OMP_NUM_THREADS", "")
    if configured.isdigit() and int(configured) > 0:
        return min(share, int(configured))
    return share


def join_and_load(spec: RankSpec, rank: int) -> tuple[StageRunner, RankGroups]:
    """Bind the device, join the group, load this rank's shard and pass the preflight; a load
    failure is reported to every rank by the preflight, which then fails everywhere."""
    layout, platform = spec.layout, spec.platform
    platform.set_device(layout.local_rank_of(rank))  # before any collective: NCCL/XCCL bind to it
    groups = init_group(layout, rank, spec.backend, spec.master_addr, spec.master_port, spec.timeout_seconds)
    device = platform.device(layout.local_rank_of(rank))
    built, load_error = None, None
    try:
        built = build_rank(spec, rank)
        built[0].set_tensor_parallel_group(groups.tensor)
    except Exception as error:  # reported with the rank by the preflight
        load_error = f"{type(error).__name__}: {error}"
    collective_preflight(
        layout,
        rank,
        groups,
        spec.backend,
        device,
        platform.current_device_index(),
        load_error,
        spec.agreement(),
    )
    assert built is not None  # the preflight raised otherwise
    model, cache, device = built
    return StageRunner(model, cache, device, layout, rank, groups.serving, groups.logits), groups


def follow_leader(runner: StageRunner, groups: RankGroups) -> None:
    """Run every step rank 0 sends until it sends the stop; raises when the group fails."""
    while True:
        box: list[StepPlan | str | None] = [None]
        dist.broadcast_object_list(box, src=0, group=groups.serving)
        message = box[0]
        if message is None:
            break
        if message == KEEPALIVE:
            dist.barrier(group=groups.serving)
            continue
        if isinstance(message, InstallLoRA):
            install_lora(runner, message)
            continue
        assert isinstance(message, StepPlan)  # rank 0 sends nothing else
        runner.run(message)
    dist.destroy_process_group()


def install_lora(runner: StageRunner, message: InstallLoRA) -> None:
    """This rank's share of an adapter into its model's slot."""
    tp_rank = runner.layout.tensor_rank_of(runner.rank)
    install_adapter(runner.model, message.slot, message.adapter, tp_rank, runner.layout.tensor)


def worker_main(spec: RankSpec, rank: int) -> None:
    """Entry point of a local worker process: join, load, preflight, follow; exit 1 on failure."""
    logging.basicConfig(level=logging.INFO, format=f"rank {rank}: %(levelname)s %(message)s")
    torch.set_num_threads(threads_per_rank(spec.layout))
    try:
        runner, groups = join_and_load(spec, rank)
        follow_leader(runner, groups)
    except Exception as error:
        logger.error("rank %d stops: %s", rank, error)
        os._exit(1)  # skip torch.distributed's teardown, which can block on a dead peer


def start_local_workers(spec: RankSpec) -> list[multiprocessing.process.BaseProcess]:
    """Start this node's ranks after its first (which is the calling process)."""
    context = multiprocessing.get_context("spawn")
    workers: list[multiprocessing.process.BaseProcess] = [
        context.Process(target=worker_main, args=(spec, rank), daemon=True, name=f"rank-{rank}")
        for rank in spec.layout.node_ranks[1:]
    ]
    for worker in workers:
        worker.start()
    return workers


def start_watching(
    spec: RankSpec, rank: int, workers: list[multiprocessing.process.BaseProcess]
) -> tuple[StageRunner, RankGroups]:
    """``join_and_load`` for the node's first rank, while watching the node's local workers: one
    that exits before the group is ready fails the start, naming it (the group would otherwise
    wait for it until the startup timeout). The join runs on a daemon thread: when the start
    fails it may still be blocked in a collective, and must not hold the process at exit."""
    outcome: list[tuple[StageRunner, RankGroups] | BaseException] = []
    done = threading.Event()

    def join() -> None:
        try:
            outcome.append(join_and_load(spec, rank))
        except BaseException as error:  # handed to the caller below
            outcome.append(error)
        done.set()

    threading.Thread(target=join, name="join", daemon=True).start()
    exited_at: float | None = None
    while not done.wait(POLL_SECONDS):
        exited = next((w for w in workers if w.exitcode is not None), None)
        if exited is None:
            continue
        # A rank that failed to load exits after the preflight has told every rank why: give
        # that message a moment to arrive before reporting the bare exit.
        exited_at = exited_at or time.monotonic()
        if time.monotonic() - exited_at >= EXIT_GRACE_SECONDS:
            raise EngineDeadError(
                f"parallel group: {exited.name} (node {spec.layout.node_rank}, backend {spec.backend}) "
                f"exited with code {exited.exitcode} while the group was starting"
            )
    result = outcome[0]
    if isinstance(result, BaseException):
        raise result
    return result


def stop_workers(workers: list[multiprocessing.process.BaseProcess], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    for worker in workers:
        worker.join(timeout=max(0.0, deadline - time.monotonic()))
        if worker.is_alive():
            worker.kill()


def run_worker_node(spec: RankSpec) -> int:
    """A node after the first (``node_rank`` ≥ 1): run its ranks until the leader stops (exit 0)
    or the group fails (exit 1, so that LeaderWorkerSet restarts the group)."""
    layout = spec.layout
    rank = layout.node_ranks[0]
    try:  # before anything starts: torch.distributed would wait for an absent leader in silence
        wait_for_leader(
            spec.master_addr,
            spec.master_port,
            spec.leader_wait_seconds or spec.timeout_seconds,
            node_rank=layout.node_rank,
        )
    except EngineDeadError as error:
        logger.error("%s", error)
        return 1
    logger.info(
        "node %d: the leader at %s:%d is up; joining the group of %d ranks (every node must join within %.0f min)",
        layout.node_rank,
        spec.master_addr,
        spec.master_port,
        layout.world,
        STARTUP_TIMEOUT.total_seconds() / 60,
    )
    torch.set_num_threads(threads_per_rank(layout))
    workers = start_local_workers(spec)
    try:
        runner, groups = start_watching(spec, rank, workers)
        logger.info(
            "node %d ready: ranks %s, stage(s) %s (backend %s); following the leader at %s:%d",
            layout.node_rank,
            list(layout.node_ranks),
            sorted({layout.stage_of(r) for r in layout.node_ranks}),
            spec.backend,
            spec.master_addr,
            spec.master_port,
        )
        follow_leader(runner, groups)
    except Exception as error:
        logger.error("node %d: the parallel group failed: %s", layout.node_rank, error)
        for worker in workers:
            worker.kill()
        return 1
    stop_workers(workers)
    logger.info("node %d: the leader stopped the group", layout.node_rank)
    return 0


class LeaderGroup:
    """Rank 0's handle on all the other ranks: start them, run steps, keep them alive, stop them."""

    def __init__(self, spec: RankSpec) -> None:
        self.spec = spec
        self.layout = spec.layout
        self._on_failure: Callable[[BaseException], None] | None = None
        self.failure: BaseException | None = None
        self._lock = threading.Lock()  # one collective at a time: steps and keepalives
        self._last_activity = time.monotonic()  # of the last collective
        self._closed = False
        self._groups: RankGroups | None = None
        self.runner: StageRunner | None = None
        self._workers = start_local_workers(spec)
        torch.set_num_threads(threads_per_rank(spec.layout))
        atexit.register(self.close)

    def set_failure_handler(self, handler: Callable[[BaseException], None]) -> None:
        """Called (from the keepalive thread) when a rank stops answering while the engine is
        idle; at once if one already has."""
        self._on_failure = handler
        if self.failure is not None:
            handler(self._failure_error())

    def _failure_error(self) -> EngineDeadError:
        return EngineDeadError(
            f"parallel group ({self.layout.world} ranks on {self.layout.nnodes} node(s), backend "
            f"{self.spec.backend}): a rank stopped answering the leader (rank 0, node 0): {self.failure}"
        )

    def start(self) -> tuple[DecoderModel, KVCache, torch.device]:
        """Join, load rank 0's shard and pass the preflight with every rank; returns rank 0's
        model, cache and device. Raises EngineDeadError naming the rank that failed."""
        try:
            self.runner, self._groups = start_watching(self.spec, 0, self._workers)
        except BaseException:
            self.close()
            raise
        logger.info(
            "parallel group ready: %d ranks (tensor %d × pipeline %d) on %d node(s), backend %s, layers by stage %s",
            self.layout.world,
            self.layout.tensor,
            self.layout.pipeline,
            self.layout.nnodes,
            self.spec.backend,
            [f"{s.start}-{s.stop - 1}" for s in self.spec.stages],
        )
        interval = max(0.5, min(10.0, self.spec.timeout_seconds / 3))
        threading.Thread(
            target=self._keep_alive, args=(interval,), name="group-keepalive", daemon=True
        ).start()
        return self.runner.model, self.runner.kv_cache, self.runner.device

    def execute(self, plan: StepPlan) -> list[torch.Tensor]:
        """Run one step on every rank; returns the logits of each micro-batch's wanted rows.
        Raises EngineDeadError when a rank fails or does not answer within the timeout."""
        assert self.runner is not None and self._groups is not None, "start() first"
        with self._lock:
            self._raise_if_failed()
            try:
                dist.broadcast_object_list([plan], src=0, group=self._groups.serving)
                logits = self.runner.run(plan)
                if self.layout.pipeline > 1:
                    logits = receive_logits(
                        plan,
                        self.spec.vocab_size,
                        self.layout.last_stage_leader,
                        self._groups.logits,
                        self.runner.device,
                        self.spec.dtype,
                    )
            except Exception as error:
                self.failure = error
                raise EngineDeadError(
                    f"parallel group ({self.layout.world} ranks on {self.layout.nnodes} node(s), backend "
                    f"{self.spec.backend}): a step failed on the leader (rank 0, node 0) while the other "
                    f"ranks ran it: {error}"
                ) from error
            self._last_activity = time.monotonic()
            return logits

    def install_lora(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Every rank puts its share of ``adapter`` in ``slot`` (between steps)."""
        assert self.runner is not None and self._groups is not None, "start() first"
        with self._lock:
            self._raise_if_failed()
            message = InstallLoRA(slot, adapter)
            try:
                dist.broadcast_object_list([message], src=0, group=self._groups.serving)
                install_lora(self.runner, message)
            except Exception as error:
                self.failure = error
                raise EngineDeadError(f"parallel group: installing a LoRA adapter failed: {error}") from error
            self._last_activity = time.monotonic()

    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise EngineDeadError(f"parallel group: failed earlier: {self.failure}")

    def _keep_alive(self, interval: float) -> None:
        while not self._closed and self.failure is None:
            time.sleep(interval / 4)
            if time.monotonic() - self._last_activity < interval:
                continue
            with self._lock:
                if self._closed or self.failure is not None:
                    return
                assert self._groups is not None  # started before this thread
                try:
                    dist.broadcast_object_list([KEEPALIVE], src=0, group=self._groups.serving)
                    dist.barrier(group=self._groups.serving)
                except Exception as error:
                    self.failure = error
                else:
                    self._last_activity = time.monotonic()
                    continue
            dead = self._failure_error()
            logger.error("%s (while idle)", dead)
            if self._on_failure is not None:
                self._on_failure(dead)
            return

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            if self._groups is not None and self.failure is None:
                try:
                    dist.broadcast_object_list([None], src=0, group=self._groups.serving)
                except Exception as error:  # a rank already gone: it is stopping anyway
                    logger.warning("parallel group: could not send the stop to every rank: %s", error)
                    self.failure = error
            if self._groups is not None and self.failure is None:
                stop_workers(self._workers)  # they got the stop
            for worker in self._workers:
                if worker.is_alive():
                    worker.kill()
            if dist.is_initialized() and self.failure is None:
                dist.destroy_process_group()
        atexit.unregister(self.close)
        self.runner, self._groups = None, None  # the model and KV cache go with the engine

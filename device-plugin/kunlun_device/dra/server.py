"""`DraServer`: the DRA kubelet plugin's life on a node — discover, serve, register, publish, watch.

Start-up discovers the cards (`XpuSource`, as the classic plugin), their XPU Link groups and the
node's versions, loads the checkpoint, runs a first health round, then:
- serves DRAPlugin v1 and v1beta1 and DRAResourceHealth on `<plugins-dir>/xpu.kunlun.dev/dra.sock`;
- serves Registration on `<registry-dir>/xpu.kunlun.dev-reg.sock`, which kubelet's plugin watcher
  finds and asks (`GetInfo`) — kubelet then dials the DRA socket;
- publishes the node's ResourceSlice (`SlicePublisher`), when an API is given.
A health thread then polls every `health_interval_seconds` (`HealthMonitor`: the classic plugin's
checks and recovery period), publishes each card's DRA health to the stream and the slice without
the unhealthy cards; the publisher reads the slice each round and creates it again when kubelet
deleted it (on kubelet's start, and ~30 s after the plugin unregistered). When kubelet registers the
plugin (again), a round runs at once. When either socket vanishes (kubelet wiped its directories on a
restart), both are served again, so the plugin watcher finds the registration socket anew.

Invariant: a failed API write or health round is logged and retried; only discovery and an
unreadable checkpoint stop the start.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
from kubernetes.client import CoreV1Api, CustomObjectsApi

from kunlun_device.api import drahealth_v1alpha1_pb2_grpc as hpb_grpc
from kunlun_device.api import pluginregistration_v1_pb2_grpc as reg_grpc
from kunlun_device.dra.driver import ClaimReader, DraDriver
from kunlun_device.dra.health import DeviceHealth, HealthServicer, device_health
from kunlun_device.dra.kube import SlicePublisher
from kunlun_device.dra.links import link_groups
from kunlun_device.dra.services import RegistrationServicer, add_dra_services
from kunlun_device.dra.slices import build_resource_slice
from kunlun_device.errors import XpuError
from kunlun_device.labels import DRA_DRIVER
from kunlun_device.plugin.placement import build_placement
from kunlun_device.plugin.states import DeviceStates
from kunlun_device.xpu.health import HealthPolicy
from kunlun_device.xpu.model import Versions
from kunlun_device.xpu.monitor import HealthMonitor, HealthSnapshot
from kunlun_device.xpu.source import XpuSource

logger = logging.getLogger(__name__)
DRA_SOCKET = "dra.sock"
REGISTRATION_SOCKET = f"{DRA_DRIVER}-reg.sock"


class DraServer:
    """One DRA kubelet plugin instance for one node.

    Args:
        source: the hardware.
        node_name: this node.
        plugins_dir: kubelet's plugins directory (the DRA socket goes in `<dir>/xpu.kunlun.dev/`).
        registry_dir: kubelet's plugins_registry directory (watched by the plugin watcher).
        cdi_dir: the container runtime's CDI spec directory.
        checkpoint_file: the claim checkpoint; default `<plugins-dir>/xpu.kunlun.dev/checkpoint.json`.
        claims: reads ResourceClaims.
        slices_api: the API clients that publish the ResourceSlice (custom objects, core); None
            publishes nothing (kubelet still prepares claims).
    """

    def __init__(
        self,
        source: XpuSource,
        node_name: str,
        plugins_dir: str | os.PathLike[str],
        registry_dir: str | os.PathLike[str],
        cdi_dir: str | os.PathLike[str],
        claims: ClaimReader,
        checkpoint_file: str | os.PathLike[str] | None = None,
        policy: HealthPolicy | None = None,
        health_interval_seconds: float = 10.0,
        watch_interval_seconds: float = 1.0,
        slices_api: tuple[CustomObjectsApi, CoreV1Api] | None = None,
    ) -> None:
        self.source = source
        self.node_name = node_name
        self.plugin_dir = Path(plugins_dir) / DRA_DRIVER
        self.registry_dir = Path(registry_dir)
        self.cdi_dir = Path(cdi_dir)
        self.claims = claims
        self.checkpoint_file = (
            Path(checkpoint_file) if checkpoint_file is not None else self.plugin_dir / "checkpoint.json"
        )
        self.policy = policy or HealthPolicy()
        self.health_interval_seconds = health_interval_seconds
        self.watch_interval_seconds = watch_interval_seconds
        self.slices_api = slices_api
        self.publisher: SlicePublisher | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()  # a health round now: stopping, or kubelet registered the plugin
        self._server: grpc.Server | None = None
        self._threads: list[threading.Thread] = []
        self._round_at = 0

    @property
    def socket_path(self) -> Path:
        return self.plugin_dir / DRA_SOCKET

    @property
    def registration_path(self) -> Path:
        return self.registry_dir / REGISTRATION_SOCKET

    def start(self) -> None:
        """Discover, load the checkpoint, serve, publish, and start the health and watch threads.

        Raises:
            XpuError: discovery failed; CheckpointError: the checkpoint is unreadable.
        """
        self.devices = self.source.list_devices()
        topology = self.source.probe_topology() if self.devices else None
        self.link_groups = link_groups(build_placement(self.devices, topology))
        if topology is None and self.devices:
            logger.warning("no XPU Link topology: linkGroup follows NUMA nodes (or the P800 halves)")
        self.versions = self._versions()
        self.monitor = HealthMonitor(self.source, self.devices, self.policy)
        first = self.monitor.poll()
        self._round_at = int(time.time())
        self.health: DeviceStates[DeviceHealth] = DeviceStates(device_health(first.states, first.findings))
        self.driver = DraDriver(
            self.node_name,
            self.devices,
            self.claims,
            self.cdi_dir,
            self.checkpoint_file,
            self.source.control_node_present(),
            self.unhealthy,
        )
        logger.info("discovered %d cards: %s", len(self.devices), [d.uuid for d in self.devices])
        self._serve()
        if self.slices_api is not None:
            self.publisher = SlicePublisher(*self.slices_api, self.node_name, self.build_slice)
            self.publisher.publish()
        for target, name in ((self._health_loop, "health"), (self._watch_loop, "watch")):
            thread = threading.Thread(target=target, name=f"kunlun-dra-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """Stop the threads and the gRPC server and remove both sockets (the checkpoint stays)."""
        self._stop.set()
        self._wake.set()
        self.health.close()
        for thread in self._threads:
            thread.join()
        self._shutdown_server()

    def unhealthy(self) -> frozenset[int]:
        """Indices of the Unhealthy cards. Unknown ones (xpu-smi failed this round) stay offered, as
        in the classic plugin: one failed call must not empty the node's slice."""
        _, health = self.health.snapshot()
        return frozenset(i for i, h in health.items() if h is DeviceHealth.UNHEALTHY)

    def build_slice(self, generation: int, node_uid: str | None) -> dict[str, object]:
        """The node's ResourceSlice now: the Unhealthy cards are left out."""
        return build_resource_slice(
            self.node_name,
            self.devices,
            self.versions,
            generation=generation,
            link_groups=self.link_groups,
            unhealthy=self.unhealthy(),
            node_uid=node_uid,
        )

    def _versions(self) -> Versions:
        try:
            return self.source.versions(self.devices)
        except XpuError as exc:
            logger.error("node versions unreadable, published without them: %s", exc)
            return Versions(None, None, None, None)

    def _serve(self) -> None:
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        self.registry_dir.mkdir(parents=True, exist_ok=True)
        for path in (self.socket_path, self.registration_path):
            path.unlink(missing_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="kunlun-dra-rpc"))
        add_dra_services(server, self.driver)
        health = HealthServicer(self.node_name, self.health, lambda: self._round_at)
        hpb_grpc.add_DRAResourceHealthServicer_to_server(health, server)
        self.registration = RegistrationServicer(str(self.socket_path), on_registered=self._wake.set)
        reg_grpc.add_RegistrationServicer_to_server(self.registration, server)
        server.add_insecure_port(f"unix://{self.socket_path}")
        server.add_insecure_port(f"unix://{self.registration_path}")
        server.start()
        self._server = server
        logger.info(
            "serving DRA driver %s on %s, registration on %s",
            DRA_DRIVER,
            self.socket_path,
            self.registration_path,
        )

    def _shutdown_server(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None).wait()
            self._server = None
        for path in (self.socket_path, self.registration_path):
            path.unlink(missing_ok=True)

    def _round(self, snapshot: HealthSnapshot) -> None:
        self._round_at = int(time.time())
        self.health.publish(device_health(snapshot.states, snapshot.findings))
        if self.publisher is not None:
            self.publisher.publish()  # reads the slice; writes when it is gone or its devices changed

    def _health_loop(self) -> None:
        while True:
            self._wake.wait(self.health_interval_seconds)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._round(self.monitor.poll())
            except Exception:
                logger.exception("DRA health round failed (retrying next round)")

    def _watch_loop(self) -> None:
        while not self._stop.wait(self.watch_interval_seconds):
            if not self.socket_path.exists() or not self.registration_path.exists():
                logger.info("a DRA socket vanished (kubelet restarted?): serving both again")
                self._shutdown_server()
                self._serve()

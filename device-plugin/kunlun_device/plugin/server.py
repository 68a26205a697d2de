"""`PluginServer`: the device plugin's life on a node — serve, register, watch health and kubelet.

Start-up discovers the cards once, serves `DevicePlugin` on `<kubelet-dir>/<socket-name>` and
registers `kunlunxin.com/xpu` with kubelet. The topology (`xpu-smi topo -m`) is optional: without it
cards lose the XPU Link preference and, when sysfs lacks it too, their NUMA node
(`kunlun_device.xpu.numa`), but the plugin still registers. Two threads then run until `stop()`:
- health: every `health_interval_seconds` one `HealthMonitor.poll()`, published to `DeviceStates`
  (which wakes every open `ListAndWatch`); with a fault responder (`kunlun_device.faults`), the
  states pass through its `observe` first (a quarantined card stays Unhealthy) and its `act` (pod
  conditions, Events, the Node) runs after the publication, so kubelet never waits for the API;
  `act` publishes what it read from the Node (a card re-admitted or quarantined there) before it
  writes any pod. The first `act` runs on this thread right after registration (never before:
  registration must not wait for the API), and an exception from `act` is logged and the loop goes
  on (a bug in the fault response must not stop the withdrawal of failing cards);
- snapshot: with a `snapshot_file`, every round (the first one at start included) also writes the
  node snapshot (`kunlun_device.xpu.snapshot`) right after the publication, before the fault
  response: what this round read and the states kubelet was just told. The labeler and the
  exporter read it instead of the hardware, so only this container needs the device nodes. A
  failed write is logged and retried next round; it never stops the health loop;
- kubelet watch: when `kubelet.sock` is recreated (kubelet restarted) or the plugin's own socket
  vanished, the gRPC server is restarted on a fresh socket and registration is repeated; a failed
  registration is retried on the next tick.

Invariant: at most one gRPC server is live; `registrations` counts successful `Register` calls.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Protocol

import grpc

from kunlun_device.api import deviceplugin_v1beta1_pb2 as pb
from kunlun_device.api import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from kunlun_device.errors import XpuError
from kunlun_device.labels import RESOURCE_NAME
from kunlun_device.plugin.placement import build_placement
from kunlun_device.plugin.servicer import DevicePluginServicer
from kunlun_device.plugin.states import DeviceStates
from kunlun_device.xpu.health import HealthPolicy
from kunlun_device.xpu.health_tracker import HealthState
from kunlun_device.xpu.model import XpuDevice
from kunlun_device.xpu.monitor import HealthMonitor, HealthSnapshot
from kunlun_device.xpu.snapshot import CardHealth, NodeSnapshot, write_snapshot
from kunlun_device.xpu.source import XpuSource

logger = logging.getLogger(__name__)
API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"


class RoundHook(Protocol):
    """What the plugin asks of a fault responder each round (see `kunlun_device.faults`)."""

    def observe(self, snapshot: HealthSnapshot) -> dict[int, HealthState]: ...

    def act(self, publish: Callable[[dict[int, HealthState]], object]) -> dict[int, HealthState]: ...


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_ctime_ns


class PluginServer:
    """One device plugin instance for one node."""

    def __init__(
        self,
        source: XpuSource,
        kubelet_dir: str | os.PathLike[str],
        socket_name: str = "kunlun-xpu.sock",
        policy: HealthPolicy | None = None,
        health_interval_seconds: float = 10.0,
        watch_interval_seconds: float = 1.0,
        fault_response: Callable[[tuple[XpuDevice, ...]], RoundHook] | None = None,
        snapshot_file: str | os.PathLike[str] | None = None,
    ) -> None:
        self.source = source
        self.kubelet_dir = Path(kubelet_dir)
        self.socket_name = socket_name
        self.policy = policy or HealthPolicy()
        self.health_interval_seconds = health_interval_seconds
        self.watch_interval_seconds = watch_interval_seconds
        self.registrations = 0
        self.fault_response = fault_response
        self.snapshot_file = Path(snapshot_file) if snapshot_file is not None else None
        self.hook: RoundHook | None = None
        self._registered = False
        self._stop = threading.Event()
        self._server: grpc.Server | None = None
        self._threads: list[threading.Thread] = []

    @property
    def socket_path(self) -> Path:
        return self.kubelet_dir / self.socket_name

    def start(self) -> None:
        """Discover, serve, register, and start the health and kubelet-watch threads.

        Raises:
            XpuError: discovery failed (no tool, unreadable output).
        """
        devices = self.source.list_devices()
        # optional: without it cards are placed by NUMA node (or index) only, never refused
        topology = self.source.probe_topology() if devices else None
        self.devices = devices
        self.placement = build_placement(devices, topology)
        self.monitor = HealthMonitor(self.source, devices, self.policy)
        self.hook = self.fault_response(devices) if self.fault_response is not None else None
        first = self.monitor.poll()
        self.states = DeviceStates(self._observe(first))
        self._record(first)
        logger.info("discovered %d cards: %s", len(devices), [d.uuid for d in devices])
        self._serve()
        self._kubelet_identity = _identity(self.kubelet_dir / KUBELET_SOCKET)
        self._register()
        for target, name in ((self._health_loop, "health"), (self._watch_loop, "kubelet-watch")):
            thread = threading.Thread(target=target, name=f"kunlun-plugin-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """Stop the threads and the gRPC server and remove the plugin's socket."""
        self._stop.set()
        self.states.close()
        for thread in self._threads:
            thread.join()
        self._shutdown_server()

    def wait(self) -> None:
        """Block until `stop()` is called from another thread (or a signal handler)."""
        self._stop.wait()

    def _serve(self) -> None:
        self.socket_path.unlink(missing_ok=True)
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="kunlun-plugin-rpc")
        )
        control = self.source.control_node_present()
        servicer = DevicePluginServicer(self.devices, self.placement, self.states, control)
        pb_grpc.add_DevicePluginServicer_to_server(servicer, server)
        server.add_insecure_port(f"unix://{self.socket_path}")
        server.start()
        self._server = server
        logger.info("serving %s on %s", RESOURCE_NAME, self.socket_path)

    def _shutdown_server(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None).wait()
            self._server = None
        self.socket_path.unlink(missing_ok=True)

    def _register(self) -> bool:
        kubelet = self.kubelet_dir / KUBELET_SOCKET
        request = pb.RegisterRequest(
            version=API_VERSION,
            endpoint=self.socket_name,
            resource_name=RESOURCE_NAME,
            options=pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True),
        )
        try:
            with grpc.insecure_channel(f"unix://{kubelet}") as channel:
                pb_grpc.RegistrationStub(channel).Register(request, timeout=5)
        except grpc.RpcError as exc:
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            logger.warning("registration with kubelet at %s failed: %s", kubelet, details)
            self._registered = False
            return False
        self.registrations += 1
        self._registered = True
        logger.info("registered %s with kubelet (%s)", RESOURCE_NAME, kubelet)
        return True

    def _health_loop(self) -> None:
        self._act()  # at once after registration: a quarantine on the Node counts from the start
        while not self._stop.wait(self.health_interval_seconds):
            snapshot = self.monitor.poll()
            self.states.publish(self._observe(snapshot))
            self._record(snapshot)
            self._act()

    def _act(self) -> None:
        if self.hook is None:
            return
        try:
            self.hook.act(self.states.publish)  # a re-admission read from the Node counts at once
        except Exception:
            logger.exception(
                "fault response failed this round (cards are still withdrawn); retrying next round"
            )

    def _record(self, health: HealthSnapshot) -> None:
        """Write this round's node snapshot, if configured; a failure is logged, never raised: the
        health loop that calls it must go on withdrawing failing cards whatever the snapshot does."""
        if self.snapshot_file is None:
            return
        try:
            self._write_snapshot(health)
        except Exception:
            logger.exception("node snapshot %s not written (retrying next round)", self.snapshot_file)

    def _write_snapshot(self, health: HealthSnapshot) -> None:
        assert self.snapshot_file is not None
        try:
            kml, kml_error = self.source.kml_version(), None
        except XpuError as exc:
            kml, kml_error = None, str(exc)
        _, states = self.states.snapshot()
        snapshot = NodeSnapshot(
            written_at=time.time(),
            interval_seconds=self.health_interval_seconds,
            devices=self.devices,
            device_nodes_present=frozenset(
                d.index for d in self.devices if self.source.device_node_present(d.index)
            ),
            table=health.table,
            tool_error=health.tool_error,
            kml_version=kml,
            kml_error=kml_error,
            health={i: CardHealth(states[i], health.findings.get(i, ())) for i in states},
        )
        write_snapshot(self.snapshot_file, snapshot)

    def _observe(self, snapshot: HealthSnapshot) -> dict[int, HealthState]:
        return snapshot.states if self.hook is None else self.hook.observe(snapshot)

    def _watch_loop(self) -> None:
        while not self._stop.wait(self.watch_interval_seconds):
            identity = _identity(self.kubelet_dir / KUBELET_SOCKET)
            if identity is None:
                continue  # kubelet is down; wait for its socket to come back
            restarted = identity != self._kubelet_identity
            if restarted or not self.socket_path.exists():
                logger.info("kubelet socket recreated or plugin socket gone: serving and registering again")
                self._kubelet_identity = identity
                self._shutdown_server()
                self._serve()
                self._register()
            elif not self._registered:
                self._register()

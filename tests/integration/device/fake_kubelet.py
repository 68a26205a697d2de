"""A test playing kubelet: the device plugin Registration server on `<dir>/kubelet.sock`.

It records every `RegisterRequest`; tests then dial the plugin's socket as kubelet would.
`FakePodResources` plays kubelet's PodResources API (`v1`, `List`) on its own socket, answering
with whatever card assignment the test sets.
"""

from __future__ import annotations

import queue
import shutil
import tempfile
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path

import grpc

from kunlun_device.api import deviceplugin_v1beta1_pb2 as pb
from kunlun_device.api import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from kunlun_device.api import podresources_v1_pb2 as pr
from kunlun_device.api import podresources_v1_pb2_grpc as pr_grpc
from kunlun_device.labels import RESOURCE_NAME
from kunlun_device.plugin import PluginServer
from kunlun_device.plugin.server import RoundHook
from kunlun_device.xpu.health import HealthPolicy
from kunlun_device.xpu.model import XpuDevice
from tests.unit.device.hosts import make_source


class _Registration(pb_grpc.RegistrationServicer):
    def __init__(self, requests: queue.Queue[pb.RegisterRequest]) -> None:
        self.requests = requests

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        self.requests.put(request)
        return pb.Empty()


class FakeKubelet:
    """Serves Registration on `<directory>/kubelet.sock`; `restart()` recreates the socket."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.registrations: queue.Queue[pb.RegisterRequest] = queue.Queue()
        self._server: grpc.Server | None = None

    @property
    def socket(self) -> Path:
        return self.directory / "kubelet.sock"

    def start(self) -> None:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_RegistrationServicer_to_server(_Registration(self.registrations), server)
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        self._server = server

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None).wait()
            self._server = None
        self.socket.unlink(missing_ok=True)

    def restart(self) -> None:
        """Like a kubelet restart: its socket and all plugin sockets are removed, then it serves again."""
        self.stop()
        for path in self.directory.iterdir():
            if path.is_socket():
                path.unlink()
        self.start()

    def next_registration(self, timeout_seconds: float = 20.0) -> pb.RegisterRequest:
        return self.registrations.get(timeout=timeout_seconds)

    def plugin_channel(self, endpoint: str) -> grpc.Channel:
        return grpc.insecure_channel(f"unix://{self.directory / endpoint}")


class _Lister(pr_grpc.PodResourcesListerServicer):
    def __init__(self, owner: FakePodResources) -> None:
        self.owner = owner

    def List(
        self, request: pr.ListPodResourcesRequest, context: grpc.ServicerContext
    ) -> pr.ListPodResourcesResponse:
        self.owner.calls += 1
        pods = []
        for (namespace, name, container), device_ids in sorted(self.owner.assignments.items()):
            devices = pr.ContainerDevices(resource_name=RESOURCE_NAME, device_ids=device_ids)
            pods.append(
                pr.PodResources(
                    name=name,
                    namespace=namespace,
                    containers=[pr.ContainerResources(name=container, devices=[devices])],
                )
            )
        return pr.ListPodResourcesResponse(pod_resources=pods)


class FakePodResources:
    """kubelet's PodResources on `socket`; `assignments[(namespace, pod, container)] = [device ids]`."""

    def __init__(self, socket: Path) -> None:
        self.socket = socket
        self.assignments: dict[tuple[str, str, str], list[str]] = {}
        self.calls = 0
        self._server: grpc.Server | None = None

    def start(self) -> None:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pr_grpc.add_PodResourcesListerServicer_to_server(_Lister(self), server)
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        self._server = server

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None).wait()
            self._server = None
        self.socket.unlink(missing_ok=True)


@contextmanager
def short_tempdir() -> Iterator[Path]:
    """A temporary folder with a short path (unix socket paths are limited to 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="kdp-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


PLUGIN_SOCKET = "kunlun-xpu.sock"


def fast_plugin(
    host_dir: Path,
    kubelet_dir: Path,
    fault_response: Callable[[tuple[XpuDevice, ...]], RoundHook] | None = None,
) -> PluginServer:
    """The plugin over the fake "p800-8" host in ``host_dir`` (see tests/unit/device/hosts.py),
    polling every 50 ms and believing a recovery at once, so tests see each change within a
    fraction of a second."""
    return PluginServer(
        make_source("p800-8", host_dir),
        kubelet_dir,
        PLUGIN_SOCKET,
        HealthPolicy(recovery_seconds=0),
        health_interval_seconds=0.05,
        watch_interval_seconds=0.05,
        fault_response=fault_response,
    )

"""A test playing kubelet: the device plugin Registration server on `<dir>/kubelet.sock`.

It records every `RegisterRequest`; tests then dial the plugin's socket as kubelet would.
"""

from __future__ import annotations

import queue
import shutil
import tempfile
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path

import grpc

from kunlun_device.api import deviceplugin_v1beta1_pb2 as pb
from kunlun_device.api import deviceplugin_v1beta1_pb2_grpc as pb_grpc


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


@contextmanager
def short_tempdir() -> Iterator[Path]:
    """A temporary folder with a short path (unix socket paths are limited to 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="kdp-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)

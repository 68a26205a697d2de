"""What the live Prometheus test scrapes: the chip exporter on a fixture host, a fake kubelet that
says which pod holds which cards, and a load that keeps a runtime's queue full.

Owns: starting the exporter process with the chart's own exporter arguments (host paths mapped to
the fixture host, the port to loopback), the kubelet PodResources fake, and `QueueLoad`.
Invariant: every process and thread started here is stopped by the context or `stop()` that
started it; waits have deadlines.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator, Mapping
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx

from kunlun_device.api import podresources_v1_pb2 as pr
from kunlun_device.api import podresources_v1_pb2_grpc as pr_grpc
from tests.support.waiting import wait_for

FIXTURE_HOST = Path(__file__).resolve().parents[1] / "fixtures" / "xpu" / "p800-8"
XPU_RESOURCE = "kunlunxin.com/xpu"


@dataclass(frozen=True, slots=True)
class PodHolding:
    """A pod container holding cards, as kubelet's PodResources API lists it."""

    namespace: str
    pod: str
    container: str
    card_uuids: tuple[str, ...]


def fixture_card_uuids() -> dict[str, str]:
    """Device name (`xpu4`) → UUID, from the fixture host's `xpu-smi -L` output."""
    lines = (FIXTURE_HOST / "outputs" / "list.txt").read_text().splitlines()
    found = (re.match(r"XPU (\d+): .* (GPU-\S+)$", line) for line in lines)
    return {f"xpu{m.group(1)}": m.group(2) for m in found if m}


class FakePodResources(pr_grpc.PodResourcesListerServicer):
    """kubelet's PodResources `List`, answering with one fixed holding."""

    def __init__(self, holding: PodHolding) -> None:
        self.holding = holding

    def List(
        self, request: pr.ListPodResourcesRequest, context: grpc.ServicerContext
    ) -> pr.ListPodResourcesResponse:
        devices = pr.ContainerDevices(resource_name=XPU_RESOURCE, device_ids=list(self.holding.card_uuids))
        container = pr.ContainerResources(name=self.holding.container, devices=[devices])
        pod = pr.PodResources(name=self.holding.pod, namespace=self.holding.namespace, containers=[container])
        return pr.ListPodResourcesResponse(pod_resources=[pod])


@contextlib.contextmanager
def pod_resources_server(socket_path: Path, holding: PodHolding) -> Iterator[None]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pr_grpc.add_PodResourcesListerServicer_to_server(FakePodResources(holding), server)  # type: ignore[no-untyped-call]
    server.add_insecure_port(f"unix://{socket_path}")
    server.start()
    try:
        yield
    finally:
        server.stop(grace=None).wait()


def exporter_arguments(chart_args: list[str], host: Path, mapped: Mapping[str, str]) -> list[str]:
    """The chart's exporter container arguments, reading fixture host `host` through its `xpu-smi`.

    The `--flag=value` pairs in `mapped` replace the chart's (or are added); a `--source` the
    chart passes (e.g. the device plugin's node snapshot, which the plugin fills from the same
    `xpu-smi`) becomes `xpu-smi`, since no plugin runs here; every other argument is kept.
    """
    host_flags = {"--xpu-smi": str(host / "xpu-smi"), "--dev-root": str(host / "root")}
    if any(arg.startswith("--source=") or arg == "--source" for arg in chart_args):
        host_flags["--source"] = "xpu-smi"
    replaced = {**host_flags, **mapped}
    kept, skip_value = [], False
    for arg in chart_args:
        if skip_value:
            skip_value = False
            continue
        flag = arg.split("=", 1)[0]
        if flag in replaced:
            skip_value = "=" not in arg  # `--flag value` spelled as two arguments
            continue
        kept.append(arg)
    return kept + [f"{flag}={value}" for flag, value in replaced.items()]


def scrape_ok(url: str, process: subprocess.Popen[bytes]) -> bool:
    """True once `url` answers; also True (stop waiting) when the process has died."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return bool(response.status == 200)
    except OSError:
        return process.poll() is not None


@dataclass(frozen=True, slots=True)
class ExporterProcess:
    """A started exporter process; `wait_ready()` before relying on its /metrics."""

    process: subprocess.Popen[bytes]
    url: str  # its /metrics
    log_path: Path

    def wait_ready(self) -> None:
        try:
            wait_for(
                lambda: scrape_ok(self.url, self.process),
                timeout_seconds=60,
                message=f"the exporter to serve {self.url}",
            )
        except AssertionError as error:
            raise AssertionError(f"{error}\nexporter log:\n{self.log_path.read_text()[-4000:]}") from None
        assert self.process.poll() is None, f"the exporter exited:\n{self.log_path.read_text()}"


@contextlib.contextmanager
def running_exporter(
    arguments: list[str], port: int, node_name: str, log_path: Path
) -> Iterator[ExporterProcess]:
    """`kunlun-device-plugin exporter ARGUMENTS` (listening on loopback `port`), started but not
    waited for (the caller starts other things meanwhile); stopped with SIGTERM (then SIGKILL)."""
    command = [sys.executable, "-m", "kunlun_device.cli", *arguments]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "NODE_NAME": node_name}
        )
    try:
        yield ExporterProcess(process, f"http://127.0.0.1:{port}/metrics", log_path)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


class QueueLoad:
    """Keeps `in_flight` completion requests open against a runtime until `stop()`: each one that
    finishes is sent again at once, so with `--max-num-seqs 1` about `in_flight - 1` always wait,
    however fast the model decodes. `stop()` cancels the open requests (the runtime aborts them
    when the client goes away)."""

    def __init__(self, base_url: str, body: dict[str, Any], in_flight: int) -> None:
        self.base_url = base_url
        self.body = body
        self.in_flight = in_flight
        self.completed = 0
        self.failures: list[str] = []  # non-200 answers, which would make the load meaningless
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="queue-load")

    def start(self) -> None:
        self._thread.start()
        assert self._started.wait(30), "the load's event loop did not start"

    def stop(self) -> None:
        if self._loop is not None and self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(60)
        assert not self._thread.is_alive(), "the load's requests did not stop"

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        limits = httpx.Limits(max_connections=self.in_flight + 1)
        async with httpx.AsyncClient(base_url=self.base_url, timeout=None, limits=limits) as client:
            workers = [asyncio.create_task(self._keep_one(client)) for _ in range(self.in_flight)]
            self._started.set()
            await self._stopping.wait()
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)

    async def _keep_one(self, client: httpx.AsyncClient) -> None:
        while True:
            response = await client.post("/v1/completions", json=self.body)
            if response.status_code != 200:
                self.failures.append(f"{response.status_code} {response.text[:200]}")
                return
            self.completed += 1

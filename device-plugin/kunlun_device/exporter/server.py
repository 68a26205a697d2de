"""`Exporter`: polls the cards and kubelet on an interval and serves the result on `/metrics`.

The polling thread refreshes one immutable `ExporterState`; scrapes only read it, so a slow
`xpu-smi` never blocks a scrape and every scrape sees one consistent round. Driver and runtime
versions are re-read from each round's table, the KML version from its file; firmware comes from
discovery at start.

The source is any `XpuReader`: `xpu-smi` itself, or the device plugin's node snapshot
(`SnapshotSource`), which the exporter reads without privileges. From a snapshot the metrics are
the same, plus `kunlun_xpu_snapshot_age_seconds`; a missing, stale or corrupt snapshot counts like a
failed `xpu-smi` call (readings left out, a tool error, `tool-error` findings), never stale values.

Invariant: `refresh()` never raises an `XpuError`; failures show up as metrics (tool errors,
findings) and logs.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from pathlib import Path
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

from kunlun_device.errors import XpuError
from kunlun_device.exporter.metrics import ExporterState, StateCollector
from kunlun_device.faults.state import read_fault_state
from kunlun_device.podresources import PodResourcesClient
from kunlun_device.xpu.health import HealthPolicy
from kunlun_device.xpu.monitor import HealthMonitor
from kunlun_device.xpu.reader import XpuReader
from kunlun_device.xpu.snapshot_source import SnapshotSource

logger = logging.getLogger(__name__)


class Exporter:
    """Chip metrics of one node."""

    def __init__(
        self,
        source: XpuReader,
        node: str,
        policy: HealthPolicy | None = None,
        interval_seconds: float = 10.0,
        pod_resources_socket: str | None = None,
        quarantine_file: Path | None = None,
    ) -> None:
        self.source = source
        self.node = node
        self.interval_seconds = interval_seconds
        self.pod_resources = PodResourcesClient(pod_resources_socket) if pod_resources_socket else None
        self.quarantine_file = quarantine_file  # written by the plugin's fault responder
        self.registry = CollectorRegistry(auto_describe=False)
        age = source.age_seconds if isinstance(source, SnapshotSource) else None
        self.registry.register(StateCollector(lambda: self._state, age))
        self._policy = policy or HealthPolicy()
        self._state: ExporterState | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._http: WSGIServer | None = None

    def start(self) -> None:
        """Discover the cards and take the first reading.

        Raises:
            XpuError: discovery failed.
        """
        self.devices = self.source.list_devices()
        self.versions = self.source.versions(self.devices)
        self.monitor = HealthMonitor(self.source, self.devices, self._policy)
        self.refresh()
        self._thread = threading.Thread(target=self._loop, name="kunlun-exporter-poll", daemon=True)
        self._thread.start()

    def serve(self, address: str, port: int) -> int:
        """Serve `/metrics` over HTTP; returns the bound port (useful with port 0)."""
        server, _ = start_http_server(port, addr=address, registry=self.registry)
        self._http = server
        logger.info("serving metrics on http://%s:%d/metrics", address, server.server_port)
        return server.server_port

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()

    def refresh(self) -> ExporterState:
        """One polling round: health and readings, holders, versions."""
        snapshot = self.monitor.poll()
        holders = self.pod_resources.holders() if self.pod_resources is not None else {}
        versions = self.versions
        if snapshot.table is not None and snapshot.table.driver_version:
            versions = replace(
                versions, driver=snapshot.table.driver_version, runtime=snapshot.table.runtime_version
            )
        try:
            versions = replace(versions, kml=self.source.kml_version())
        except XpuError as exc:
            logger.warning("KML version: %s", exc)
        self.versions = versions
        state = ExporterState(
            node=self.node,
            devices=self.devices,
            versions=versions,
            snapshot=snapshot,
            holders=holders,
            transitions_total=dict(self.monitor.tracker.transitions_total),
            tool_errors_total=self.monitor.tool_errors_total,
            fault=read_fault_state(self.quarantine_file) if self.quarantine_file else None,
        )
        self._state = state
        return state

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_seconds):
            self.refresh()

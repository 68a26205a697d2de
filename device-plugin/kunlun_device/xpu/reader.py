"""`XpuReader`: the reads the labeler, the exporter and the health monitor make of one node.

Two sources satisfy it: `XpuSource` (runs `xpu-smi`, reads `/dev` and sysfs itself: needs the
device nodes, so a privileged container) and `SnapshotSource` (reads the node snapshot the device
plugin writes each round: needs one read-only file and nothing of the host). Code typed against
this Protocol cannot tell them apart, which is what keeps the labels and metrics the same.

Invariant: every method raises only `XpuError` subclasses (the callers' retry and tool-error paths
catch exactly that), except `device_node_present`, which answers a plain bool.
"""

from __future__ import annotations

from typing import Protocol

from kunlun_device.xpu.model import SmiTable, Versions, XpuDevice


class XpuReader(Protocol):
    """Cards, versions and telemetry of one node."""

    def list_devices(self) -> tuple[XpuDevice, ...]:
        """The node's cards (raises `XpuError` when they cannot be read)."""
        ...

    def versions(self, devices: tuple[XpuDevice, ...] | None = None) -> Versions:
        """Driver, runtime, firmware (of `devices`, if they agree) and KML versions."""
        ...

    def telemetry(self) -> SmiTable:
        """The current summary table: per-card readings and the driver/runtime versions."""
        ...

    def kml_version(self) -> str | None:
        """The KML version; None when the node has none."""
        ...

    def device_node_present(self, index: int) -> bool:
        """Whether `/dev/xpu<index>` exists."""
        ...

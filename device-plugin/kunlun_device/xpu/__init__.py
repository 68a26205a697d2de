"""Hardware access for Kunlun XPUs: the only code that reads `xpu-smi`, `/dev/xpu*` and sysfs.

Public API (imported by the runtime's Kunlun platform and by the plugin, labeler and exporter):
`XpuSource(xpu_smi="xpu-smi", root="/")` with `list_devices()`, `versions()`, `telemetry()`,
`topology()`; `SnapshotSource(path)`, the same reads from the device plugin's node snapshot
(`kunlun_device.xpu.snapshot`), both `XpuReader`s; the value types below; health evaluation in
`kunlun_device.xpu.health`.
No torch, no Kubernetes, no gRPC here.
"""

from kunlun_device.xpu.model import (
    CardDetail,
    CardTelemetry,
    ListedCard,
    SmiTable,
    Topology,
    Versions,
    XpuDevice,
)
from kunlun_device.xpu.reader import XpuReader
from kunlun_device.xpu.smi_list import parse_smi_list, parse_smi_topo
from kunlun_device.xpu.smi_query import parse_smi_query
from kunlun_device.xpu.smi_table import parse_smi_table
from kunlun_device.xpu.snapshot_source import SnapshotSource
from kunlun_device.xpu.source import DEFAULT_KML_VERSION_FILE, XpuSource

__all__ = [
    "DEFAULT_KML_VERSION_FILE",
    "CardDetail",
    "CardTelemetry",
    "ListedCard",
    "SmiTable",
    "SnapshotSource",
    "Topology",
    "Versions",
    "XpuDevice",
    "XpuReader",
    "XpuSource",
    "parse_smi_list",
    "parse_smi_query",
    "parse_smi_table",
    "parse_smi_topo",
]

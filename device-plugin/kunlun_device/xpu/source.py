"""`XpuSource`: the one place that runs `xpu-smi` and reads `/dev` and sysfs.

Everything is relative to two parameters, the `xpu-smi` command and a filesystem root, so that tests
point them at fixture hosts. Device node paths handed to kubelet are host paths (`/dev/xpuN`)
whatever the root: the root only says where this process sees the host's files.

Invariant: a tool failure or unreadable output raises an `XpuError` subclass; nothing here guesses.
The one exception is the topology, which is optional: without it NUMA nodes are unknown (None) and
a warning naming the cards is logged once per source.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
from pathlib import Path

from kunlun_device.errors import XpuError, XpuParseError, XpuToolFailedError, XpuToolMissingError
from kunlun_device.xpu.model import SmiTable, Topology, Versions, XpuDevice
from kunlun_device.xpu.numa import resolve_numa
from kunlun_device.xpu.smi_list import parse_smi_list, parse_smi_topo
from kunlun_device.xpu.smi_query import parse_smi_query
from kunlun_device.xpu.smi_table import NO_DEVICES, parse_smi_table

DEFAULT_KML_VERSION_FILE = "/usr/local/xpu/kml/VERSION"
_VERSION = re.compile(r"^[0-9A-Za-z][0-9A-Za-z.+_-]*$")
logger = logging.getLogger(__name__)


class XpuSource:
    """Reads cards, versions, topology and telemetry of one node.

    Args:
        xpu_smi: the `xpu-smi` command, a path or a name looked up on PATH.
        root: where the host's `/dev` and `/sys` are visible (``/`` on the host itself).
        kml_version_file: host path (resolved under `root`) of the KML version, either a plain
            version string or a JSON report with a ``kml_version`` key; None disables KML.
        timeout_seconds: limit for one `xpu-smi` call.
    """

    def __init__(
        self,
        xpu_smi: str = "xpu-smi",
        root: str | os.PathLike[str] = "/",
        kml_version_file: str | None = DEFAULT_KML_VERSION_FILE,
        timeout_seconds: float = 10.0,
    ) -> None:
        self.xpu_smi = xpu_smi
        self.root = Path(root)
        self.kml_version_file = kml_version_file
        self.timeout_seconds = timeout_seconds
        self._warnings_logged: set[str] = set()

    def host_path(self, path: str) -> Path:
        """Where this process sees the host path `path`."""
        return self.root / path.lstrip("/")

    def run(self, *args: str) -> str:
        """Run `xpu-smi ARGS` and return its standard output.

        Raises:
            XpuToolMissingError: the command does not exist.
            XpuToolFailedError: non-zero exit (other than "no devices"), timeout, or no output.
        """
        command = shutil.which(self.xpu_smi)
        if command is None:
            raise XpuToolMissingError(self.xpu_smi)
        argv = [self.xpu_smi, *args]
        try:
            done = subprocess.run(
                [command, *args], capture_output=True, text=True, timeout=self.timeout_seconds, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise XpuToolFailedError(argv, f"timed out after {self.timeout_seconds:g}s") from exc
        except OSError as exc:
            raise XpuToolFailedError(argv, str(exc)) from exc
        if done.returncode != 0 and not NO_DEVICES.match(done.stdout):
            detail = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or ["no output"]
            raise XpuToolFailedError(argv, f"exit status {done.returncode}: {detail[0]}")
        if not done.stdout.strip():
            raise XpuToolFailedError(argv, "no output")
        return done.stdout

    def telemetry(self) -> SmiTable:
        """The summary table: driver/runtime versions and per-card readings."""
        return parse_smi_table(self.run())

    def topology(self) -> Topology:
        """Card links and NUMA affinity from `xpu-smi topo -m`.

        Raises:
            XpuError: no such subcommand, failure, or a layout `parse_smi_topo` does not know.
        """
        return parse_smi_topo(self.run("topo", "-m"))

    def probe_topology(self) -> Topology | None:
        """The topology, or None (with a warning logged once) when `xpu-smi` cannot give one."""
        try:
            return self.topology()
        except XpuError as exc:
            self._warn_once(f"no card topology, allocating without XPU Link preference: {exc}")
            return None

    def list_devices(self) -> tuple[XpuDevice, ...]:
        """Discover the cards: `-L` for the list, `-q --id=N` for each card's detail.

        NUMA nodes come from sysfs (`sys/bus/pci/devices/<bdf>/numa_node`) or, failing that, from
        the topology matrix; None when neither knows (logged once, naming the cards and why). A
        missing or unreadable topology is no error.
        """
        listed = parse_smi_list(self.run("-L")) if not self._no_devices() else ()
        details = {
            card.index: parse_smi_query(self.run("-q", f"--id={card.index}"), f"xpu-smi -q --id={card.index}")
            for card in listed
        }
        probe = resolve_numa({i: self._sysfs_numa(d.bus_id) for i, d in details.items()}, self.topology)
        if probe.unknown_reason is not None:
            cards = ", ".join(f"xpu{index}" for index in probe.unknown_ids)
            self._warn_once(
                f"NUMA node unknown for {cards} ({probe.unknown_reason}); they are advertised to "
                "kubelet without NUMA topology"
            )
        return tuple(
            XpuDevice(
                index=index,
                uuid=detail.uuid,
                product=detail.product,
                memory_total_bytes=detail.memory_total_bytes,
                bus_id=detail.bus_id,
                numa_node=probe.numa_nodes[index],
                device_path=f"/dev/xpu{index}",
                firmware_version=detail.firmware_version,
            )
            for index, detail in details.items()
        )

    def versions(self, devices: tuple[XpuDevice, ...] | None = None) -> Versions:
        """Driver and XPU-RT (table header), firmware (cards, if all agree) and KML versions."""
        table = self.telemetry()
        cards = self.list_devices() if devices is None else devices
        firmware = {card.firmware_version for card in cards}
        return Versions(
            driver=table.driver_version or None,
            runtime=table.runtime_version or None,
            firmware=firmware.pop() if len(firmware) == 1 else None,
            kml=self.kml_version(),
        )

    def kml_version(self) -> str | None:
        """The KML version from the configured file; None when unset or absent."""
        if self.kml_version_file is None:
            return None
        path = self.host_path(self.kml_version_file)
        source = str(self.kml_version_file)
        try:
            text = path.read_text().strip()
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as exc:  # a directory, no permission, not text
            raise XpuError(f"{source}: cannot be read: {exc}") from exc
        if text.startswith("{"):
            try:
                value = json.loads(text).get("kml_version")
            except (json.JSONDecodeError, AttributeError) as exc:
                raise XpuParseError(source, 1, text.splitlines()[0], "not a JSON object") from exc
            text = value if isinstance(value, str) else ""
        line = text.splitlines()[0].strip() if text else ""
        if not _VERSION.match(line):
            raise XpuParseError(source, 1, line, "not a version string")
        return line

    def device_node_present(self, index: int) -> bool:
        """True when `/dev/xpu<index>` exists under the root."""
        return self.host_path(f"/dev/xpu{index}").exists()

    def control_node_present(self) -> bool:
        """True when `/dev/xpuctrl` exists under the root."""
        return self.host_path("/dev/xpuctrl").exists()

    def _warn_once(self, message: str) -> None:
        # the labeler rediscovers every round; a node without topology stays so, say it once
        if message not in self._warnings_logged:
            self._warnings_logged.add(message)
            logger.warning("%s", message)

    def _no_devices(self) -> bool:
        return not parse_smi_table(self.run()).cards

    def _sysfs_numa(self, bus_id: str) -> int | None:
        if not bus_id:
            return None
        domain, rest = bus_id.lower().split(":", 1)
        bdf = f"{domain[-4:]}:{rest}"
        try:
            value = int(self.host_path(f"/sys/bus/pci/devices/{bdf}/numa_node").read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        return value if value >= 0 else None

"""`SnapshotSource`: an `XpuReader` over the device plugin's node snapshot file.

Lets the labeler and the exporter run unprivileged, with no device node and no `xpu-smi`: they see
what the plugin's `XpuSource` answered in its last round (`kunlun_device.xpu.snapshot`).

Reads: `list_devices()` and `telemetry()` read the file afresh (each starts a round of its
caller); `versions()`, `kml_version()` and `device_node_present()` answer from the snapshot those
last read, so one round never mixes two snapshots. A round the plugin could not read replays its
failure: `telemetry()` raises when the plugin's `xpu-smi` failed, `kml_version()` when its KML file
was unreadable, exactly as `XpuSource` would have.

Freshness: a snapshot older than `max_age_seconds` (default: `STALE_INTERVALS` of the writer's
poll period, at least `MIN_MAX_AGE_SECONDS`) raises `SnapshotStaleError`, a missing file
`SnapshotMissingError`, anything unreadable `SnapshotCorruptError` — all `XpuError`s, so callers
treat them like a failed `xpu-smi` call (the labeler keeps its labels, the exporter leaves the
readings out). While no usable snapshot is at hand `device_node_present` answers True: an unknown
device node is not reported missing.

Invariant: no method returns data from a snapshot that was stale or unreadable when read.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from kunlun_device.errors import SnapshotMissingError, SnapshotStaleError, XpuError
from kunlun_device.xpu.model import SmiTable, Versions, XpuDevice
from kunlun_device.xpu.snapshot import NodeSnapshot, parse_snapshot

STALE_INTERVALS = 3
# A plugin round is its interval plus xpu-smi calls (each up to its timeout) plus the fault
# response's API calls (each up to theirs): on a slow API server one round alone can outlast three
# short intervals, and a false "stale" drops every reading of a healthy node.
MIN_MAX_AGE_SECONDS = 90.0


class SnapshotSource:
    """Reads one node snapshot file.

    Args:
        path: the file the plugin writes (`plugin --snapshot-file`).
        max_age_seconds: oldest usable snapshot; None: derived from the writer's poll period.
        clock: Unix time (`time.time`), injectable for tests.
    """

    def __init__(
        self,
        path: str | Path,
        max_age_seconds: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = Path(path)
        self.max_age_seconds = max_age_seconds
        self._clock = clock
        self._snapshot: NodeSnapshot | None = None  # the last usable one read; None after a failure
        self._written_at: float | None = None  # of the last one parsed, stale or not

    def read(self) -> NodeSnapshot:
        """Read and check the file now.

        Raises:
            SnapshotMissingError, SnapshotCorruptError, SnapshotStaleError.
        """
        self._snapshot = None
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            raise SnapshotMissingError(str(self.path), "missing (is the device plugin writing it?)") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise SnapshotMissingError(str(self.path), f"unreadable: {exc}") from exc
        snapshot = parse_snapshot(text, str(self.path))
        self._written_at = snapshot.written_at
        age = self._clock() - snapshot.written_at
        bound = self.bound_seconds(snapshot)
        if age > bound:
            raise SnapshotStaleError(
                str(self.path),
                f"stale: written {age:.0f}s ago, more than {bound:g}s (is the device plugin polling?)",
            )
        self._snapshot = snapshot
        return snapshot

    def bound_seconds(self, snapshot: NodeSnapshot) -> float:
        """The oldest age at which `snapshot` is still used."""
        if self.max_age_seconds is not None:
            return self.max_age_seconds
        return max(STALE_INTERVALS * snapshot.interval_seconds, MIN_MAX_AGE_SECONDS)

    def age_seconds(self) -> float | None:
        """Age of the last snapshot parsed (usable or stale); None before any."""
        if self._written_at is None:
            return None
        return max(self._clock() - self._written_at, 0.0)

    def list_devices(self) -> tuple[XpuDevice, ...]:
        return self.read().devices

    def telemetry(self) -> SmiTable:
        snapshot = self.read()
        if snapshot.table is None:
            raise XpuError(f"the device plugin's xpu-smi failed: {snapshot.tool_error or 'no reason given'}")
        return snapshot.table

    def versions(self, devices: tuple[XpuDevice, ...] | None = None) -> Versions:
        """As `XpuSource.versions`: the table's driver and runtime, the cards' common firmware, KML."""
        snapshot = self._current()
        if snapshot.table is None:
            raise XpuError(f"the device plugin's xpu-smi failed: {snapshot.tool_error or 'no reason given'}")
        cards = snapshot.devices if devices is None else devices
        firmware = {card.firmware_version for card in cards}
        return Versions(
            driver=snapshot.table.driver_version or None,
            runtime=snapshot.table.runtime_version or None,
            firmware=firmware.pop() if len(firmware) == 1 else None,
            kml=self.kml_version(),
        )

    def kml_version(self) -> str | None:
        snapshot = self._current()
        if snapshot.kml_error is not None:
            raise XpuError(f"the device plugin could not read the KML version: {snapshot.kml_error}")
        return snapshot.kml_version

    def device_node_present(self, index: int) -> bool:
        snapshot = self._snapshot
        return True if snapshot is None else index in snapshot.device_nodes_present

    def _current(self) -> NodeSnapshot:
        return self._snapshot if self._snapshot is not None else self.read()

"""Errors of `kunlun_device`: one hierarchy, each naming what went wrong and where.

Invariant: unparseable tool output is never turned into zeros; it raises `XpuParseError`, which
quotes the offending line. One bad card never takes a servicer down: callers catch `XpuError`.
"""

from __future__ import annotations


class XpuError(Exception):
    """Base class of every error raised by `kunlun_device`."""


class XpuToolMissingError(XpuError):
    """The `xpu-smi` command does not exist or is not executable."""

    def __init__(self, command: str) -> None:
        super().__init__(f"xpu-smi not found or not executable: {command!r}")
        self.command = command


class XpuToolFailedError(XpuError):
    """`xpu-smi` ran but exited non-zero, timed out, or wrote no output."""

    def __init__(self, argv: list[str], reason: str) -> None:
        super().__init__(f"{' '.join(argv)}: {reason}")
        self.argv = argv
        self.reason = reason


class XpuParseError(XpuError):
    """Output of `xpu-smi` (or a version file) that this package cannot read.

    Attributes:
        source: which output was being parsed (e.g. ``xpu-smi -q --id=3``).
        line_number: 1-based line number in that output, or None when the whole output is at fault.
        line: the offending line, verbatim.
    """

    def __init__(self, source: str, line_number: int | None, line: str, reason: str) -> None:
        where = f"line {line_number}" if line_number is not None else "output"
        super().__init__(f"{source}: {reason} at {where}: {line!r}")
        self.source = source
        self.line_number = line_number
        self.line = line
        self.reason = reason


class UnknownDeviceError(XpuError):
    """A device id that this node does not have (e.g. in an `Allocate` request)."""

    def __init__(self, device_ids: list[str]) -> None:
        super().__init__(f"unknown device ids: {', '.join(sorted(device_ids))}")
        self.device_ids = sorted(device_ids)


class AllocationError(XpuError):
    """A preferred-allocation request that cannot be satisfied (size larger than available)."""


class ConfigError(XpuError):
    """A bad command-line value or policy, naming the flag or field."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class ApiConfigError(XpuError):
    """No usable Kubernetes API configuration: the message names what is missing (the
    `--kubeconfig` file, or both the in-cluster service account and a kubeconfig)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"no Kubernetes API access: {reason}")
        self.reason = reason


class SnapshotError(XpuError):
    """The device plugin's node snapshot cannot be used (see `kunlun_device.xpu.snapshot`).

    Attributes:
        path: the snapshot file.
        reason: what is wrong with it.
    """

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"node snapshot {path}: {reason}")
        self.path = path
        self.reason = reason


class SnapshotMissingError(SnapshotError):
    """No snapshot file (the plugin has not written one yet, or does not run with --snapshot-file)."""


class SnapshotCorruptError(SnapshotError):
    """A snapshot file that is not the JSON document the plugin writes."""


class SnapshotStaleError(SnapshotError):
    """A snapshot older than the reader's bound: the plugin stopped polling."""


class FaultStateError(XpuError):
    """A fault-response record that cannot be used: the Node's failure-history annotation or the
    plugin's state file (see `kunlun_device.faults.history` and `kunlun_device.faults.state`).

    Attributes:
        source: the annotation key or the file path.
        reason: what is wrong with it, naming the field.
    """

    def __init__(self, source: str, reason: str) -> None:
        super().__init__(f"{source}: {reason}")
        self.source = source
        self.reason = reason


class CheckpointError(XpuError):
    """The DRA plugin's checkpoint file cannot be used (see `kunlun_device.dra.checkpoint`).

    Attributes:
        path: the checkpoint file.
        reason: what is wrong with it, naming the field.
    """

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"DRA checkpoint {path}: {reason}")
        self.path = path
        self.reason = reason


class ClaimError(XpuError):
    """A ResourceClaim this node cannot prepare (answered to kubelet for that claim alone)."""

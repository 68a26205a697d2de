"""Parser of `xpu-smi -q --id=N`: indented `key : value` detail of one card.

Keys are addressed by their section path, e.g. `Firmware Version/ALL Version` or
`ECC Errors/Volatile/DRAM Uncorrectable`. Section headers are lines without ` : `.

Invariant: a required field that is missing is an error naming the field; a value that does not
have the expected form is an error quoting its line.
"""

from __future__ import annotations

import re

from kunlun_device.errors import XpuParseError
from kunlun_device.xpu.model import MIB, CardDetail

_KEY_VALUE = re.compile(r"^(?P<indent>\s*)(?P<key>\S.*?)\s+:(?:\s+(?P<value>.*?))?\s*$")
_SECTION = re.compile(r"^(?P<indent>\s*)(?P<name>\S.*?)\s*$")
_MIB = re.compile(r"^(\d+) MiB$")


def _flatten(text: str, source: str) -> dict[str, tuple[str, int, str]]:
    """Map each `section/key` path to (value, line number, line)."""
    fields: dict[str, tuple[str, int, str]] = {}
    stack: list[tuple[int, str]] = []  # (indent, section name)
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("="):
            continue
        match = _KEY_VALUE.match(line)
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = "/".join(name for _, name in stack)
        if match is not None:
            key = f"{path}/{match['key']}" if path else match["key"]
            fields[key] = (match["value"] or "", number, line)
            continue
        section = _SECTION.match(line)
        if section is None:  # pragma: no cover - _SECTION matches any non-blank line
            raise XpuParseError(source, number, line, "neither a section nor 'key : value'")
        stack.append((indent, section["name"]))
    return fields


def _find(fields: dict[str, tuple[str, int, str]], suffix: str) -> tuple[str, int, str] | None:
    """The field whose path ends with `suffix` (the card section's name varies with its bus id)."""
    for path, entry in fields.items():
        if path == suffix or path.endswith("/" + suffix):
            return entry
    return None


def _required(fields: dict[str, tuple[str, int, str]], suffix: str, source: str) -> tuple[str, int, str]:
    entry = _find(fields, suffix)
    if entry is None or not entry[0]:
        raise XpuParseError(source, None, "", f"missing field {suffix!r}")
    return entry


def _int(entry: tuple[str, int, str], source: str, what: str) -> int:
    value, number, line = entry
    if not value.isdigit():
        raise XpuParseError(source, number, line, f"{what} is not a whole number")
    return int(value)


def _optional_int(fields: dict[str, tuple[str, int, str]], suffix: str, source: str) -> int | None:
    entry = _find(fields, suffix)
    if entry is None or entry[0] == "N/A":
        return None
    return _int(entry, source, suffix)


def parse_smi_query(text: str, source: str = "xpu-smi -q") -> CardDetail:
    """Parse the detail of one card.

    Args:
        text: the output of `xpu-smi -q --id=N`.
        source: how to name this output in errors.
    Raises:
        XpuParseError: a required field missing or malformed.
    """
    fields = _flatten(text, source)
    memory = _required(fields, "Memory Usage/Total", source)
    memory_match = _MIB.match(memory[0])
    if memory_match is None:
        raise XpuParseError(source, memory[1], memory[2], "memory total is not '<n> MiB'")
    firmware = _find(fields, "Firmware Version/ALL Version")
    bus = _find(fields, "PCI/Bus Id")
    return CardDetail(
        index=_int(_required(fields, "Minor Number", source), source, "Minor Number"),
        uuid=_required(fields, "XPU UUID", source)[0],
        product=_required(fields, "Product Name", source)[0],
        bus_id=bus[0] if bus is not None else "",
        firmware_version=firmware[0] if firmware is not None and firmware[0] else None,
        memory_total_bytes=int(memory_match[1]) * MIB,
        ecc_correctable_errors=_optional_int(fields, "ECC Errors/Volatile/DRAM Correctable", source),
        ecc_uncorrectable_errors=_optional_int(fields, "ECC Errors/Volatile/DRAM Uncorrectable", source),
    )

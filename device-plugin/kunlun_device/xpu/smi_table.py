"""Parser of the default `xpu-smi` summary table (the `nvidia-smi`-like view).

Layout: an optional timestamp line, a header box with `Driver Version: X    XPU-RT Version: Y`, the
column legend, a `|===...|` rule, then three lines per card (index/name/bus-id/ECC; fan/temp/power/
memory/util; L3/SR-IOV) separated by `+---+` rules, and finally a processes box that is ignored.

Invariant: every card line either matches its expected shape or `XpuParseError` quotes it; a
reading shown as `N/A` becomes None, never 0.
"""

from __future__ import annotations

import re

from kunlun_device.errors import XpuParseError
from kunlun_device.xpu.model import MIB, CardTelemetry, SmiTable

SOURCE = "xpu-smi"
NO_DEVICES = re.compile(r"^\s*No (?:devices|XPUs?) (?:were )?found", re.IGNORECASE)
_HEADER = re.compile(r"Driver Version:\s*(?P<driver>\S+)\s+XPU-RT Version:\s*(?P<rt>\S+)")
_ROW1 = (
    re.compile(r"^\s*(?P<index>\d+)\s+(?P<name>\S.*?)\s+(?P<persist>\S+)\s*$"),
    re.compile(r"^\s*(?P<bus>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])\s+\S+\s*$"),
    re.compile(r"^\s*(?P<ecc>\d+|N/A)\s*$"),
)
_ROW2 = (
    re.compile(
        r"^\s*\S+\s+(?P<temp>\d+(?:\.\d+)?C|N/A)\s+\S+\s+"
        r"(?P<power>\d+(?:\.\d+)?W|N/A)\s*/\s*(?P<cap>\d+(?:\.\d+)?W|N/A)\s*$"
    ),
    re.compile(r"^\s*(?P<used>\d+)MiB\s*/\s*(?P<total>\d+)MiB\s*$"),
    re.compile(r"^\s*(?P<util>\d+)%\s+\S.*$"),
)
_ROW3 = (
    re.compile(r"^\s*$"),
    re.compile(r"^\s*\d+MiB\s*/\s*\d+MiB\s*$|^\s*N/A\s*$"),
    re.compile(r"^\s*\S.*$"),
)


def _number(text: str, unit: str) -> float | None:
    return None if text == "N/A" else float(text.removesuffix(unit))


def _cells(line_number: int, line: str, patterns: tuple[re.Pattern[str], ...]) -> dict[str, str]:
    """Split a `| a | b | c |` line and match each cell; the named groups of all three, merged."""
    stripped = line.strip()
    parts = stripped.split("|")
    if len(parts) != 5 or parts[0] or parts[4]:
        raise XpuParseError(SOURCE, line_number, line, "expected a card line with three cells")
    groups: dict[str, str] = {}
    for cell, pattern in zip(parts[1:4], patterns, strict=True):
        match = pattern.match(cell)
        if match is None:
            raise XpuParseError(SOURCE, line_number, line, f"unexpected cell {cell.strip()!r}")
        groups.update({k: v for k, v in match.groupdict().items() if v is not None})
    return groups


def _card(lines: list[tuple[int, str]]) -> CardTelemetry:
    (n1, l1), (n2, l2), (n3, l3) = lines
    row1 = _cells(n1, l1, _ROW1)
    row2 = _cells(n2, l2, _ROW2)
    _cells(n3, l3, _ROW3)
    used, total = int(row2["used"]), int(row2["total"])
    util = int(row2["util"])
    if used > total or util > 100:
        raise XpuParseError(SOURCE, n2, l2, "memory used exceeds total or utilisation over 100%")
    return CardTelemetry(
        index=int(row1["index"]),
        product=row1["name"],
        bus_id=row1["bus"],
        temperature_celsius=_number(row2["temp"], "C"),
        power_watts=_number(row2["power"], "W"),
        power_limit_watts=_number(row2["cap"], "W"),
        memory_used_bytes=used * MIB,
        memory_total_bytes=total * MIB,
        utilization_ratio=util / 100,
        ecc_uncorrectable_errors=None if row1["ecc"] == "N/A" else int(row1["ecc"]),
    )


def parse_smi_table(text: str) -> SmiTable:
    """Parse the default `xpu-smi` output.

    Returns:
        The header versions and the cards in printed order; no cards when the tool reports none.
    Raises:
        XpuParseError: no header, a malformed card line, or a truncated card block.
    """
    lines = text.splitlines()
    numbered = list(enumerate(lines, start=1))
    if any(NO_DEVICES.match(line) for line in lines):
        return SmiTable(driver_version="", runtime_version="", cards=())
    header = next(((n, _HEADER.search(line)) for n, line in numbered if _HEADER.search(line)), None)
    if header is None:
        first = next(((n, line) for n, line in numbered if line.strip()), (None, ""))
        raise XpuParseError(SOURCE, first[0], first[1], "no 'Driver Version' header")
    header_number, match = header
    assert match is not None
    rule = next((n for n, line in numbered if line.startswith("|====")), None)
    if rule is None:
        raise XpuParseError(SOURCE, header_number, lines[header_number - 1], "no card table after header")
    cards: list[CardTelemetry] = []
    block: list[tuple[int, str]] = []
    for number, line in numbered[rule:]:
        if "Processes:" in line:
            break
        if line.startswith("|"):
            block.append((number, line))
            if len(block) == 3:
                cards.append(_card(block))
                block = []
        elif line.startswith("+") and not block:
            continue
        elif block:
            raise XpuParseError(SOURCE, number, line, "card block cut short")
        else:
            break  # the blank line before the processes box ends the card table
    if block:
        raise XpuParseError(SOURCE, block[-1][0], block[-1][1], "card block cut short")
    return SmiTable(driver_version=match["driver"], runtime_version=match["rt"], cards=tuple(cards))

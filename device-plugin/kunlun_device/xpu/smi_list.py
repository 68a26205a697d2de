"""Parsers of the two small `xpu-smi` listings: `-L` (cards) and `topo -m` (link matrix).

`-L` prints one `XPU <index>: <product>  <uuid>` line per card (some versions wrap the uuid as
`(UUID: ...)`). `topo -m` prints a matrix whose rows are `XPU<i>` and whose columns are `XPU<j>`,
`NIC<k>`, then `CPU Affinity` and `NUMA Affinity`; cells are link kinds (`X` self, `XL` XPU Link,
`PIX`, `PXB`, `PHB`, `NODE`, `SYS`). Legends after the matrix are ignored.

Invariant: any line in the data part that does not have this shape raises `XpuParseError`.
"""

from __future__ import annotations

import re

from kunlun_device.errors import XpuParseError
from kunlun_device.xpu.model import ListedCard, Topology

_LISTED = re.compile(
    r"^XPU\s+(?P<index>\d+):\s+(?P<product>\S.*?)\s+\(?(?:UUID:\s*)?(?P<uuid>[A-Za-z]+-[0-9a-fA-F-]+)\)?\s*$"
)
_COLUMN = re.compile(r"^(XPU|NIC)\d+$")
_LINK = re.compile(r"^(X|XL|PIX|PXB|PHB|NODE|SYS|SOC|NV\d+)$")


def parse_smi_list(text: str) -> tuple[ListedCard, ...]:
    """Parse `xpu-smi -L`. Raises XpuParseError on any non-blank line that is not a card."""
    cards: list[ListedCard] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        match = _LISTED.match(line.strip())
        if match is None:
            raise XpuParseError("xpu-smi -L", number, line, "expected 'XPU <index>: <product> <uuid>'")
        cards.append(ListedCard(int(match["index"]), match["product"], match["uuid"]))
    return tuple(cards)


def parse_smi_topo(text: str) -> Topology:
    """Parse `xpu-smi topo -m`.

    Returns:
        Symmetric card-to-card links and each card's NUMA node (when the column reports one).
    Raises:
        XpuParseError: no header line, or a row whose cells do not match the header.
    """
    source = "xpu-smi topo -m"
    lines = list(enumerate(text.splitlines(), start=1))
    header = next(((n, line) for n, line in lines if line.split() and line.split()[0] == "XPU0"), None)
    if header is None:
        first = next(((n, line) for n, line in lines if line.strip()), (None, ""))
        raise XpuParseError(source, first[0], first[1], "no 'XPU0 XPU1 ...' header")
    columns = [token for token in header[1].split() if _COLUMN.match(token)]
    has_numa = "NUMA Affinity" in header[1]
    links: dict[tuple[int, int], str] = {}
    numa_nodes: dict[int, int] = {}
    for number, line in lines[header[0] :]:
        tokens = line.split()
        if not tokens:
            break  # the legend follows a blank line
        if not re.fullmatch(r"XPU\d+", tokens[0]):
            raise XpuParseError(source, number, line, "expected a row starting with 'XPU<n>'")
        row = int(tokens[0][3:])
        cells = tokens[1 : 1 + len(columns)]
        if len(cells) != len(columns) or not all(_LINK.match(cell) for cell in cells):
            raise XpuParseError(source, number, line, "link cells do not match the header")
        for column, cell in zip(columns, cells, strict=True):
            if column.startswith("XPU") and int(column[3:]) != row:
                links[(row, int(column[3:]))] = cell
        rest = tokens[1 + len(columns) :]
        if has_numa and rest and rest[-1].isdigit():
            numa_nodes[row] = int(rest[-1])
    for (a, b), kind in list(links.items()):
        if links.get((b, a), kind) != kind:
            # xpu-smi has been seen to print asymmetric cells; trust only a link both rows agree on
            links[(a, b)] = links[(b, a)] = "SYS"
    return Topology(links=links, numa_nodes=numa_nodes)

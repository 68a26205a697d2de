"""The chart's values documentation: every value carries a `# --` comment in values.yaml, and the
chart README's values table is generated from those comments.

Owns: parsing values.yaml's comment structure and rendering charts/kunlun-inference/README.md.
Invariant: a key with a `# --` comment is a documented value (whatever is nested below it is its
default); a key without one is a section and must contain documented values.
Regenerate the README with `.venv/bin/python -m tests.chart.values_doc --write`.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "kunlun-inference"
KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_.-]+):(?P<rest>.*)$")
BEGIN, END = "<!-- values-table:begin -->", "<!-- values-table:end -->"


@dataclass(frozen=True, slots=True)
class DocumentedValue:
    path: str  # dotted key path, e.g. operator.webhook.port
    description: str  # the `# --` comment, continuation lines joined
    line: int  # 1-based line number in values.yaml


class UndocumentedValueError(ValueError):
    """A key in values.yaml that is neither documented nor a section of documented values."""


def parse_documented_values(text: str) -> list[DocumentedValue]:
    """Return the documented values of a values.yaml text, in file order.

    Raises UndocumentedValueError naming the key and its line when a value has no comment.
    """
    values: list[DocumentedValue] = []
    stack: list[tuple[int, str, int]] = []  # (indent, key, line) of open sections
    children: dict[str, int] = {}
    pending: list[str] | None = None
    skip_deeper_than: int | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        indent = len(line) - len(line.lstrip(" "))
        if skip_deeper_than is not None:
            if not stripped or indent > skip_deeper_than:
                continue
            skip_deeper_than = None
        if not stripped:
            pending = None
            continue
        if stripped.startswith("# --"):
            pending = [stripped[4:].strip()]
            continue
        if stripped.startswith("#"):
            if pending is not None:
                pending.append(stripped[1:].strip())
            continue
        match = KEY_LINE.match(line)
        if match is None:
            raise UndocumentedValueError(f"values.yaml:{number}: cannot parse {line!r}")
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([s[1] for s in stack] + [match["key"]])
        if stack:
            children[".".join(s[1] for s in stack)] = children.get(".".join(s[1] for s in stack), 0) + 1
        if pending is not None:
            values.append(DocumentedValue(path, " ".join(pending), number))
            skip_deeper_than = indent
        elif match["rest"].split("#")[0].strip():
            raise UndocumentedValueError(f"values.yaml:{number}: {path} has no `# --` comment")
        else:
            stack.append((indent, match["key"], number))
            children.setdefault(path, 0)
        pending = None
    empty = [path for path, count in children.items() if count == 0 and path not in {v.path for v in values}]
    if empty:
        raise UndocumentedValueError(f"values.yaml: {empty[0]} has no `# --` comment and no documented keys")
    return values


def lookup(data: dict, path: str) -> object:
    node: object = data
    for part in path.split("."):
        assert isinstance(node, dict)
        node = node[part]
    return node


def render_table(values_text: str) -> str:
    """The Markdown values table for a values.yaml text."""
    data = yaml.safe_load(values_text)
    rows = ["| Key | Default | Description |", "| --- | --- | --- |"]
    for value in parse_documented_values(values_text):
        default = json.dumps(lookup(data, value.path), separators=(", ", ": "))
        default = default.replace("|", "\\|")
        rows.append(f"| `{value.path}` | `{default}` | {value.description} |")
    return "\n".join(rows)


def render_readme(readme_text: str, values_text: str) -> str:
    """`readme_text` with the part between the table markers replaced by a fresh table."""
    head, rest = readme_text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{render_table(values_text)}\n{END}{tail}"


def main(argv: list[str]) -> int:
    readme = CHART / "README.md"
    fresh = render_readme(readme.read_text(), (CHART / "values.yaml").read_text())
    if "--write" in argv:
        readme.write_text(fresh)
        return 0
    if fresh != readme.read_text():
        print(
            "charts/kunlun-inference/README.md is stale: run "
            "`.venv/bin/python -m tests.chart.values_doc --write`",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

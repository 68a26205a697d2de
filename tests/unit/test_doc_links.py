"""Every relative link in the Markdown docs resolves to a file inside the repository, anchors included.

Checked: README.md, docs/**/*.md and the charts' READMEs. A link is `[text](target)` or
`![alt](target)`; targets with a scheme (https:, mailto:) are left alone. A target must exist and
must not leave the repository; `#anchor` into a Markdown file must name one of its headings by
GitHub's slug. Links inside code blocks and code spans are not links.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted({ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "charts").rglob("README.md")})

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"`+[^`]*`+")
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)(?:\s+#+)?\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks, code spans removed."""
    lines, fence = [], None
    for number, line in enumerate(text.splitlines(), start=1):
        marker = line.lstrip()[:3]
        if marker in ("```", "~~~"):
            fence = None if fence == marker else fence or marker
            continue
        if fence is None:
            lines.append((number, CODE_SPAN.sub("", line)))
    return lines


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: link text kept, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    """Every anchor a link into `doc` may use (repeated headings get -1, -2, … as on GitHub)."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    text = doc.read_text(encoding="utf-8")
    for _, line in prose_lines(text):
        if match := HEADING.match(line):
            slug = github_slug(match[1])
            found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    found.update(HTML_ANCHOR.findall(text))
    return found


def broken_links(doc: Path, root: Path = ROOT) -> list[str]:
    """`line: target: why` for each relative link in `doc` that does not resolve inside `root`."""
    broken = []
    for number, line in prose_lines(doc.read_text(encoding="utf-8")):
        for target in LINK.findall(line):
            if not target or SCHEME.match(target):
                continue
            path, _, anchor = unquote(target).partition("#")
            base = root if path.startswith("/") else doc.parent
            resolved = (base / path.lstrip("/")).resolve() if path else doc
            if not resolved.is_relative_to(root):
                broken.append(f"{number}: {target}: leaves the repository")
            elif not resolved.exists():
                broken.append(f"{number}: {target}: no such file")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{number}: {target}: no heading #{anchor} in {resolved.relative_to(root)}")
    return broken


def test_the_checked_docs_include_the_readme_and_docs() -> None:
    names = {doc.relative_to(ROOT).as_posix() for doc in DOCS}
    assert {"README.md", "docs/architecture.md", "docs/performance.md"} <= names


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(doc: Path) -> None:
    assert broken_links(doc) == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.relative_to(ROOT).as_posix())
def test_no_doc_points_outside_the_repository_to_shared_notes(doc: Path) -> None:
    assert "../shared" not in doc.read_text(encoding="utf-8")


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        ("Against llama.cpp", "against-llamacpp"),
        ("CPU tiers", "cpu-tiers"),
        ("Versions: `versions.yaml`", "versions-versionsyaml"),
        ("`kunlun-runtime preflight`", "kunlun-runtime-preflight"),
        ("Intel Xeon (AVX-512 BF16 + AMX), 29 Nov 2026", "intel-xeon-avx-512-bf16--amx-29-nov-2026"),
        ("The operator: `KIS` → version-locked", "the-operator-kis--version-locked"),
    ],
)
def test_github_slug(heading: str, slug: str) -> None:
    assert github_slug(heading) == slug


def test_a_broken_link_is_reported_with_its_line(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Title\n\n## Two words\n\n## Two words\n")
    readme = tmp_path / "README.md"
    readme.write_text(
        "[ok](docs/a.md#two-words) [ok too](docs/a.md#two-words-1) [web](https://example.com)\n"
        "```\n[in a code block](missing.md)\n```\n"
        "`[in a code span](missing.md)` [gone](docs/b.md)\n"
        "[bad anchor](docs/a.md#three) [self](#title) [out](../elsewhere/x.md)\n"
    )
    assert broken_links(readme, tmp_path) == [
        "5: docs/b.md: no such file",
        "6: docs/a.md#three: no heading #three in docs/a.md",
        "6: #title: no heading #title in README.md",
        "6: ../elsewhere/x.md: leaves the repository",
    ]

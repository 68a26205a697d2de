"""Every value in values.yaml is documented, and the chart README's table is generated from them."""

from __future__ import annotations

import pytest
import yaml

from tests.chart.values_doc import (
    BEGIN,
    CHART,
    END,
    UndocumentedValueError,
    parse_documented_values,
    render_readme,
)


def _leaf_paths(data: object, prefix: str = "") -> set[str]:
    if isinstance(data, dict) and data:
        return set().union(*(_leaf_paths(v, f"{prefix}.{k}" if prefix else k) for k, v in data.items()))
    return {prefix}


def test_every_value_in_values_yaml_has_a_doc_comment() -> None:
    text = (CHART / "values.yaml").read_text()
    documented = {v.path for v in parse_documented_values(text)}
    leaves = _leaf_paths(yaml.safe_load(text))
    # Each leaf is documented itself or sits inside a documented structured default.
    undocumented = {
        leaf for leaf in leaves if not any(leaf == d or leaf.startswith(d + ".") for d in documented)
    }
    assert undocumented == set()
    assert all(v.description for v in parse_documented_values(text))


def test_parser_names_an_undocumented_value_and_its_line() -> None:
    text = "# -- documented\na: 1\nsection:\n  # -- fine\n  b: 2\n  c: 3\n"
    with pytest.raises(UndocumentedValueError, match=r"values.yaml:6: section.c has no `# --` comment"):
        parse_documented_values(text)


def test_parser_rejects_an_empty_undocumented_section() -> None:
    with pytest.raises(UndocumentedValueError, match="lonely has no"):
        parse_documented_values("lonely:\n# -- x\nb: 1\n")


def test_parser_treats_nested_structure_under_a_documented_key_as_its_default() -> None:
    text = "s:\n  # -- the affinity\n  # (continued)\n  aff:\n    node:\n      x: 1\n  # -- port\n  port: 2\n"
    assert [(v.path, v.description, v.line) for v in parse_documented_values(text)] == [
        ("s.aff", "the affinity (continued)", 4),
        ("s.port", "port", 8),
    ]


def test_chart_readme_values_table_is_up_to_date() -> None:
    readme = (CHART / "README.md").read_text()
    assert BEGIN in readme and END in readme
    fresh = render_readme(readme, (CHART / "values.yaml").read_text())
    assert readme == fresh, "stale: run `.venv/bin/python -m tests.chart.values_doc --write`"

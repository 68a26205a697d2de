"""values.schema.json is strict: Helm itself rejects bad values with a message naming the field."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tests.chart.tools import CHART, RELEASE, helm

BAD_VALUES = [
    # (id, values, the field path Helm must name, the words of the complaint)
    ("unknown-top-level-key", {"operater": {"replicas": 2}}, "at ''", "'operater' not allowed"),
    ("unknown-nested-key", {"operator": {"replica": 2}}, "at '/operator'", "'replica' not allowed"),
    ("zero-replicas", {"operator": {"replicas": 0}}, "at '/operator/replicas'", "minimum"),
    ("replicas-as-string", {"operator": {"replicas": "two"}}, "at '/operator/replicas'", "want integer"),
    (
        "bad-pull-policy",
        {"operator": {"image": {"pullPolicy": "Sometimes"}}},
        "at '/operator/image/pullPolicy'",
        "value must be one of",
    ),
    (
        "webhook-failure-policy",
        {"operator": {"webhook": {"failurePolicy": "Maybe"}}},
        "at '/operator/webhook/failurePolicy'",
        "value must be one of",
    ),
    (
        "port-out-of-range",
        {"devicePlugin": {"exporter": {"port": 70000}}},
        "at '/devicePlugin/exporter/port'",
        "maximum",
    ),
    (
        "relative-host-path",
        {"devicePlugin": {"hostPaths": {"dev": "dev"}}},
        "at '/devicePlugin/hostPaths/dev'",
        "does not match pattern",
    ),
    (
        "kv-ratio-over-one",
        {"monitoring": {"prometheusRule": {"objectives": {"kvCacheUsageRatio": 95}}}},
        "at '/monitoring/prometheusRule/objectives/kvCacheUsageRatio'",
        "maximum",
    ),
    (
        "bad-scrape-interval",
        {"monitoring": {"serviceMonitor": {"interval": "30 seconds"}}},
        "at '/monitoring/serviceMonitor/interval'",
        "does not match pattern",
    ),
    (
        "matrix-entry-missing-kml",
        {
            "compatibility": {
                "extraEntries": [{"runtime": "0.1.0", "driver": ["5.0.22"], "firmware": ["1.3.9"]}]
            }
        },
        "at '/compatibility/extraEntries/0'",
        "missing property 'kml'",
    ),
    (
        "matrix-version-not-a-version",
        {
            "compatibility": {
                "extraEntries": [
                    {"runtime": "0.1.0", "driver": ["latest"], "firmware": ["1.3.9"], "kml": ["3.2.1"]}
                ]
            }
        },
        "at '/compatibility/extraEntries/0/driver/0'",
        "does not match pattern",
    ),
    *(
        (
            f"kml-file-in-root-{name}",
            {"runtime": {"preflight": {"kmlVersionFile": path}}},
            "at '/runtime/preflight/kmlVersionFile'",
            "does not match pattern",
        )
        for name, path in (("root", "/VERSION"), ("dot", "/./VERSION"), ("double-slash", "//VERSION"))
    ),
    ("label-value-not-a-string", {"commonLabels": {"team": 7}}, "at '/commonLabels/team'", "want string"),
]


@pytest.mark.parametrize(
    ("values", "field", "complaint"), [b[1:] for b in BAD_VALUES], ids=[b[0] for b in BAD_VALUES]
)
def test_schema_rejects_bad_values_naming_the_field(
    values: dict, field: str, complaint: str, tmp_path: Path
) -> None:
    path = tmp_path / "bad-values.yaml"
    path.write_text(yaml.safe_dump(values))
    proc = helm("template", RELEASE, str(CHART), "--values", str(path), check=False)
    assert proc.returncode != 0, "helm accepted bad values"
    assert "don't meet the specifications of the schema" in proc.stderr, proc.stderr
    assert f"{field}'" in proc.stderr or f"{field}:" in proc.stderr, proc.stderr
    assert complaint in proc.stderr, proc.stderr


KML_PATHS = [
    ("", True),
    ("/usr/local/xpu/kml/VERSION", True),
    ("/etc/.kml/..VERSION", True),
    ("/etc/.../VERSION", True),
    ("/VERSION", False),  # its directory, what the preflight mounts, is the node's root
    ("/./VERSION", False),
    ("//VERSION", False),
    ("/etc/../VERSION", False),
    ("/etc/./kml/VERSION", False),
    ("/etc//kml/VERSION", False),
    ("/etc/kml/", False),
    ("etc/kml/VERSION", False),
]


@pytest.mark.parametrize(("path", "allowed"), KML_PATHS)
def test_the_kml_file_pattern_agrees_with_the_operators_check(path: str, allowed: bool) -> None:
    """The chart refuses what ``kunlun-operator run --preflight-kml-version-file`` refuses (the
    pattern uses no lookaround, so Python's ``re`` reads it as Helm's Go regexp does)."""
    from kunlun_operator.shell.cli import build_parser, parse_preflight_host

    schema = json.loads((CHART / "values.schema.json").read_text())
    pattern = schema["properties"]["runtime"]["properties"]["preflight"]["properties"]["kmlVersionFile"]
    assert (re.search(pattern["pattern"], path) is not None) == allowed
    args = build_parser().parse_args(["run", "--preflight-kml-version-file", path])
    if allowed:
        assert parse_preflight_host(args).kml_version_file == (path or None)
    else:
        with pytest.raises(SystemExit, match="--preflight-kml-version-file"):
            parse_preflight_host(args)


def _walk(schema: dict, path: str = "") -> list[tuple[str, dict]]:
    found = [(path, schema)]
    for key, sub in schema.get("properties", {}).items():
        found += _walk(sub, f"{path}.{key}")
    return found


def test_every_object_in_the_schema_forbids_unknown_keys_unless_it_is_free_form() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    # Free-form on purpose: Kubernetes objects passed through verbatim, and label maps.
    open_objects = {
        path
        for path, node in _walk(schema)
        if node.get("type") == "object"
        and node.get("additionalProperties", True) is not False
        and "properties" in node
    }
    assert open_objects == set()


def test_schema_describes_exactly_the_keys_of_values_yaml() -> None:
    """No value lacks a schema and no schema entry is a value the chart does not have."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def keys_with_schema(node: dict, data: object, path: str) -> set[str]:
        # Container `resources` mirror Kubernetes' type: optional keys, not chart values.
        if "properties" not in node or not isinstance(data, dict) or path.endswith(".resources"):
            return {path}
        out = set()
        for key in set(node["properties"]) | set(data):
            assert key in node["properties"], f"{path}.{key} has no schema"
            assert key in data, f"schema property {path}.{key} is not in values.yaml"
            out |= keys_with_schema(node["properties"][key], data[key], f"{path}.{key}")
        return out

    assert keys_with_schema(schema, values, "")

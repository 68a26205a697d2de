"""`kunlun-operator render` configured as the chart configures the operator (docs/operator.md, "Dry run:
render"): the operator container's args as `--config`, the admission policy and the compatibility
matrix from the chart's ConfigMaps. Every example renders, with the image the chart's matrix names."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kunlun_operator import names
from kunlun_operator.shell.cli import main
from tests.chart.tools import REPO, render
from tests.unit.operator.factories import example_names

POLICY_PATH = "/etc/kunlun-operator/policy/policy.yaml"  # where the chart mounts it in the operator pod


def test_the_charts_operator_flags_configure_render(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    chart = render(
        overrides={
            "admissionPolicy": {"hostPaths": ["/data/models"]},
            "leaderWorkerSet": {"installed": True},
            "routing": {"enabled": True},
            "devicePlugin": {"nodePools": {"dra": "dra"}},  # so the operator runs with --dra
        }
    )
    [operator] = chart.one("Deployment", "-operator")["spec"]["template"]["spec"]["containers"]
    assert f"--admission-policy={POLICY_PATH}" in operator["args"]
    assert "--dra" in operator["args"]
    policy = tmp_path / "policy.yaml"
    policy.write_text(chart.one("ConfigMap", "-admission-policy")["data"]["policy.yaml"])
    matrix = tmp_path / "matrix.yaml"
    matrix.write_text(chart.one("ConfigMap", "-compatibility")["data"]["matrix.yaml"])
    config = tmp_path / "operator-flags.yaml"
    config.write_text(yaml.safe_dump([a.replace(POLICY_PATH, str(policy)) for a in operator["args"]]))
    chart_matrix = yaml.safe_load(matrix.read_text())
    certified = f"{chart_matrix['registry']}/{chart_matrix['entries'][-1]['image']}"

    for example in example_names():
        path = REPO / "examples" / example
        argv = ["render", "-f", str(path), "--config", str(config), "--compatibility-matrix", str(matrix)]
        routing = ["-a", names.INFERENCE_GROUP_VERSION, "-a", names.GATEWAY_GROUP_VERSION]
        code = main([*argv, "-a", names.LWS_GROUP_VERSION, *routing, "-a", names.DRA_GROUP_VERSION])
        out, err = capsys.readouterr()
        assert (code, err) == (0, ""), example
        [workload] = [
            o
            for o in yaml.safe_load_all(out)
            if o["kind"] in ("Deployment", "LeaderWorkerSet") and not o["metadata"]["name"].endswith("-epp")
        ]
        spec = workload["spec"]
        template = spec["template"] if "template" in spec else spec["leaderWorkerTemplate"]["leaderTemplate"]
        wanted = yaml.safe_load(path.read_text())["spec"].get("runtime", {}).get("image", certified)
        assert template["spec"]["containers"][0]["image"] == wanted, example

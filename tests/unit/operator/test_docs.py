"""docs/operator.md's `kubectl get kis` output is what the printer columns show for kis-minimal.yaml."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from kunlun_operator.decide.reconcile import reconcile
from kunlun_operator.decide.status import DeploymentFacts
from kunlun_operator.spec.service import ServiceRef, parse_spec_or_error
from tests.unit.operator.crd_schema import load_crd
from tests.unit.operator.factories import NOW, load_example, make_facts

DOC = Path(__file__).resolve().parents[3] / "docs" / "operator.md"


def _column(obj: dict[str, Any], json_path: str) -> str:
    value: Any = obj
    for key in json_path.strip(".").split("."):
        value = value.get(key, "") if isinstance(value, dict) else ""
    return str(value)


def test_the_documented_kubectl_get_row_matches_the_printer_columns() -> None:
    header, row = re.search(r"kubectl get kis\n```\n```\n(.+)\n(.+)\n```", DOC.read_text()).groups()
    example = load_example("kis-minimal.yaml")
    ref = ServiceRef(example["metadata"]["name"], "default", "uid-1", 1)
    ready = DeploymentFacts(
        spec_replicas=1,
        replicas=1,
        ready_replicas=1,
        updated_replicas=1,
        generation=1,
        observed_generation=1,
        progressing_reason="NewReplicaSetAvailable",
    )
    status = reconcile(
        ref, parse_spec_or_error(example["spec"]), None, make_facts(deployment=ready), now=NOW
    ).status
    columns = [
        c for c in load_crd()["spec"]["versions"][0]["additionalPrinterColumns"] if not c.get("priority")
    ]
    obj = {**example, "status": status}
    shown = [example["metadata"]["name"]] + [
        _column(obj, c["jsonPath"]) for c in columns if c["name"] != "Age"
    ]
    assert header.split() == ["NAME"] + [c["name"].upper() for c in columns]
    assert row.split()[:-1] == shown  # all but AGE


def test_the_documented_multi_node_rejection_is_the_operators_message() -> None:
    """docs/operator.md and docs/chart.md quote the denial a multi-node service gets without LWS."""
    from kunlun_operator.builders.leaderworkerset import require_leaderworkerset
    from kunlun_operator.spec.service import parse_spec

    example = load_example("kis-multinode.yaml")
    error = require_leaderworkerset(parse_spec(example["spec"]), served=False)
    assert error is not None
    for doc in (DOC, DOC.parent / "chart.md"):
        quoted = re.findall(r"```text\n(spec\.runtime\.pipelineParallelSize: .+)\n```", doc.read_text())
        assert quoted == [str(error)], doc.name


def test_the_documented_claim_template_and_dra_denial_are_what_the_operator_makes() -> None:
    """docs/operator.md "Allocation": the worked template is the builder's for examples/kis-dra.yaml,
    and the quoted denial is the one a dra service gets without --dra."""
    from kunlun_operator.decide.allocation import claim_template, require_dra
    from kunlun_operator.policy.matrix import load_default_matrix, select_image
    from kunlun_operator.spec.service import parse_service_ref, parse_spec

    body = load_example("kis-dra.yaml")
    body["metadata"]["namespace"] = "default"
    spec = parse_spec(body["spec"])
    matrix = load_default_matrix()
    image = select_image(matrix, spec.versions, "unused")
    built = claim_template(parse_service_ref(body), spec, matrix, image)
    section = DOC.read_text().split("## Allocation", 1)[1].split("\n## ", 1)[0]
    documented = yaml.safe_load(re.findall(r"```yaml\n(.+?)```", section, re.S)[0])
    assert documented == built
    error = require_dra(spec, dra_served=False)
    assert re.findall(r"```text\n(spec\.resources\.allocation: .+)\n```", section) == [str(error)]

"""``kunlun-operator render`` against the real operator on the fake API: for every example, the objects
it prints are the ones the operator creates; a refused service gets the webhook's own denial.

Both run with the same flags: the operator gets them on its command line, render reads them from its
``--config`` file (a YAML list, as the chart passes them).
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kunlun_operator import names
from kunlun_operator.shell.render import PROG
from tests.integration.operator.conftest import NAMESPACE, Cluster, wait_for
from tests.integration.operator.test_admission import _accepts, review
from tests.unit.operator.factories import EXAMPLES, example_names, make_raw_spec

pytestmark = [pytest.mark.slow, pytest.mark.monitoring, pytest.mark.leaderworkerset, pytest.mark.routing]
#: The policy the examples need (their models on the nodes' /data/models, the project's images).
POLICY = "runtimeImages: [ghcr.io/kunlun-inference/]\nhostPaths: [/data/models]\n"
API_VERSIONS = (
    names.LWS_GROUP_VERSION,
    names.MONITORING_GROUP_VERSION,
    names.INFERENCE_GROUP_VERSION,
    names.GATEWAY_GROUP_VERSION,
    names.DRA_GROUP_VERSION,
)
#: What the API server adds to an object: not part of what the operator asks for.
SERVER_SET = ("uid", "resourceVersion", "generation", "creationTimestamp", "managedFields")


def operator_flags(tmp_path: Path) -> list[str]:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    # --dra: kis-dra.yaml claims its cards through Dynamic Resource Allocation
    return ["--admission-policy", str(policy), "--preflight-xpu-smi", "/usr/local/bin/xpu-smi", "--dra"]


def render(tmp_path: Path, path: Path, flags: list[str], *extra: str) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "operator-flags.yaml"
    config.write_text(yaml.safe_dump(["run", *flags]))
    command = [sys.executable, "-m", "kunlun_operator.shell.cli", "render", "-f", str(path)]
    command += ["--config", str(config), *extra]
    return subprocess.run(command, capture_output=True, text=True, check=False, timeout=60)


def owned_objects(cluster: Cluster, namespace: str, service: str) -> dict[tuple[str, str], dict[str, Any]]:
    """Every object of an owned kind that ``service`` owns, by (kind, name)."""
    found = {}
    for kind in names.OWNED_KINDS:
        group = kind.api_version.rpartition("/")[0]
        for obj in cluster.kube.objects(kind.plural, group):
            meta = obj["metadata"]
            if meta["namespace"] == namespace and any(
                ref["name"] == service for ref in meta.get("ownerReferences") or []
            ):
                found[(kind.kind, meta["name"])] = obj
    return found


def without_uid(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` with its owner reference's uid blank, as render prints it for a file without one."""
    obj = copy.deepcopy(obj)
    for ref in obj["metadata"].get("ownerReferences") or []:
        ref["uid"] = ""
    return obj


def as_requested(live: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``live`` without what the API server set, and the object the operator last applied (its
    ``last-applied`` annotation, which the operator adds to what it writes)."""
    obj = copy.deepcopy(live)
    obj.pop("status", None)
    meta = obj["metadata"]
    for key in SERVER_SET:
        meta.pop(key, None)
    annotations = meta.pop("annotations")
    applied = json.loads(annotations.pop(names.ANNOTATION_LAST_APPLIED))
    if annotations:
        meta["annotations"] = annotations
    return without_uid(obj), without_uid(applied)


@pytest.mark.parametrize("example", example_names())
def test_render_prints_exactly_what_the_operator_creates(
    cluster: Cluster, tmp_path: Path, example: str
) -> None:
    body = yaml.safe_load((EXAMPLES / example).read_text())
    namespace = body["metadata"].get("namespace") or NAMESPACE
    flags = operator_flags(tmp_path)
    api_versions = [arg for version in API_VERSIONS for arg in ("--api-versions", version)]
    rendered = render(tmp_path, EXAMPLES / example, flags, "--namespace", namespace, *api_versions)
    assert rendered.returncode == 0, rendered.stderr
    assert rendered.stderr == ""
    printed = list(yaml.safe_load_all(rendered.stdout))
    assert rendered.stdout.startswith("---\n") and all(printed)

    cluster.start_operator(*flags)
    body["metadata"]["namespace"] = namespace
    name = body["metadata"]["name"]
    cluster.custom.create_namespaced_custom_object(names.GROUP, names.VERSION, namespace, names.PLURAL, body)
    wait_for(
        lambda: (
            cluster.custom.get_namespaced_custom_object(
                names.GROUP, names.VERSION, namespace, names.PLURAL, name
            )
            .get("status", {})
            .get("observedGeneration")
        ),
        message="the operator's first pass",
    )
    live = owned_objects(cluster, namespace, name)
    assert sorted(live) == sorted((o["kind"], o["metadata"]["name"]) for o in printed)
    for obj in printed:
        created, applied = as_requested(live[(obj["kind"], obj["metadata"]["name"])])
        assert applied == obj  # what the operator asked for
        assert created == obj  # what the API server stored
    assert {o["kind"] for o in printed} >= {"ConfigMap", "Service", "PodDisruptionBudget"}


def test_a_refused_service_gets_the_webhooks_own_denial(cluster: Cluster, tmp_path: Path) -> None:
    flags = operator_flags(tmp_path)
    port = cluster.start_operator(*flags).webhook_port
    wait_for(lambda: _accepts(port), message="the webhook server")
    versions = {"driver": "5.0.20", "firmware": "1.0.2.14.1.54", "kml": "3.2.0"}
    refused = {
        "spec.resources.xpus": make_raw_spec(resources={"xpus": 3}, runtime={"tensorParallelSize": 2}),
        "spec.model.source.hostPath.path": make_raw_spec(
            model={"name": "m", "source": {"hostPath": {"path": "/etc"}}}
        ),
        "spec.versions.driver": make_raw_spec(versions=versions),
    }
    for field, spec in refused.items():
        denial = review(port, copy.deepcopy(spec))["status"]["message"]
        assert denial.startswith(f"{field}: ")
        path = tmp_path / "service.yaml"
        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": names.API_VERSION,
                    "kind": names.KIND,
                    "metadata": {"name": "qwen", "namespace": NAMESPACE},
                    "spec": spec,
                }
            )
        )
        rendered = render(tmp_path, path, flags)
        assert (rendered.returncode, rendered.stdout) == (1, "")
        said = f"{path}: KunlunInferenceService {NAMESPACE}/qwen is refused "
        assert re.fullmatch(rf"{PROG}: {re.escape(said)}\(\w+\): {re.escape(denial)}\n", rendered.stderr), (
            rendered.stderr
        )

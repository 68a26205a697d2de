"""``kunlun-operator render`` in-process: valid objects for every example, errors that name the field,
and what its flags assume of the cluster and the operator (tests/integration/operator/test_render.py
compares its output with what the operator creates)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kunlun_operator import names
from kunlun_operator.shell.cli import main
from tests.unit.operator.crd_schema import (
    load_httproute_crd,
    load_inferencepool_crd,
    load_lws_crd,
    validate_cr,
)
from tests.unit.operator.factories import EXAMPLES, VERSIONS, example_names, make_raw_spec

EVERY_API = [
    *("-a", names.LWS_GROUP_VERSION, "-a", names.MONITORING_GROUP_VERSION),
    *("-a", names.INFERENCE_GROUP_VERSION, "-a", names.GATEWAY_GROUP_VERSION),
    *("-a", names.DRA_GROUP_VERSION),
]
#: The other projects' kinds the examples create, and their real CRDs (tests/fixtures/external).
EXTERNAL_CRDS = {"InferencePool": load_inferencepool_crd, "HTTPRoute": load_httproute_crd}
#: No schema of the Prometheus Operator's kinds is at hand: their builders are tested by equality.
NO_SCHEMA = {"ServiceMonitor", "PrometheusRule"}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["render", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def write_config(tmp_path: Path, flags: list[str]) -> str:
    """The operator's flags as render reads them, the examples' host paths allowed."""
    policy = tmp_path / "policy.yaml"
    policy.write_text("runtimeImages: [ghcr.io/kunlun-inference/]\nhostPaths: [/data/models]\n")
    config = tmp_path / "flags.yaml"
    config.write_text(yaml.safe_dump(["run", f"--admission-policy={policy}", *flags]))
    return str(config)


def write_service(tmp_path: Path, spec: dict[str, Any], **metadata: str) -> str:
    path = tmp_path / "service.yaml"
    body = {"apiVersion": names.API_VERSION, "kind": names.KIND, "metadata": {"name": "qwen", **metadata}}
    path.write_text(yaml.safe_dump({**body, "spec": spec}))
    return str(path)


@pytest.mark.parametrize("example", example_names())
def test_every_example_renders_objects_valid_for_kubernetes(
    example: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path, ["--dra"])
    code, out, err = run(capsys, "-f", str(EXAMPLES / example), "--config", config, *EVERY_API)
    assert (code, err) == (0, "")
    objects = list(yaml.safe_load_all(out))
    # resource.k8s.io/v1 (a DRA service's claims) is Kubernetes >= 1.34
    k8s = "1.34.0" if "ResourceClaimTemplate" in {o["kind"] for o in objects} else "1.31.0"
    for obj in objects:
        if obj["kind"] == "LeaderWorkerSet":
            assert validate_cr(obj, load_lws_crd())[1] == []
            for role in ("leaderTemplate", "workerTemplate"):
                template = obj["spec"]["leaderWorkerTemplate"][role]
                pod = {
                    "apiVersion": "v1",
                    "kind": "PodTemplate",
                    "metadata": {"name": "t"},
                    "template": template,
                }
                kubernetes_validate.validate(pod, k8s, strict=True)
        elif obj["kind"] in EXTERNAL_CRDS:
            assert validate_cr(obj, EXTERNAL_CRDS[obj["kind"]]())[1] == []
        elif obj["kind"] not in NO_SCHEMA:
            kubernetes_validate.validate(obj, k8s, strict=True)
    # the same bytes every time, objects in apply order, the runtime's config file as a block
    assert run(capsys, "-f", str(EXAMPLES / example), "--config", config, *EVERY_API)[1] == out
    assert [o["kind"] for o in objects][:2] == ["ConfigMap", "Service"]
    assert "  config.yaml: |\n" in out and "&id" not in out


def test_a_bad_service_prints_the_admission_error_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_service(tmp_path, make_raw_spec(resources={"xpus": 3}, runtime={"tensorParallelSize": 2}))
    code, out, err = run(capsys, "-f", path)
    assert (code, out) == (1, "")
    assert err == (
        f"kunlun-operator render: {path}: KunlunInferenceService default/qwen is refused (InvalidSpec): "
        "spec.resources.xpus: 3 is not a multiple of spec.runtime.tensorParallelSize (2)\n"
    )


def test_without_the_webhook_only_the_reconcile_decides(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A model too big for its card is denied by the webhook; without one the operator deploys it.
    too_big = make_raw_spec(model={"name": "m", "source": {"pvc": {"claimName": "c"}}, "parameters": "70B"})
    path = write_service(tmp_path, too_big)
    code, _, err = run(capsys, "-f", path)
    assert code == 1 and "refused (InsufficientMemory): spec.resources.xpus: the model does not fit" in err
    code, out, err = run(capsys, "-f", path, "--config", write_config(tmp_path, ["--webhook-port=0"]))
    assert (code, err) == (0, "")
    assert "Deployment" in [o["kind"] for o in yaml.safe_load_all(out)]


def test_the_cluster_is_assumed_fresh_unless_told_otherwise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path, [])
    production = str(EXAMPLES / "kis-production.yaml")
    code, out, _ = run(capsys, "-f", production, "--config", config)
    assert code == 0
    kinds = [o["kind"] for o in yaml.safe_load_all(out)]
    assert kinds == ["ConfigMap", "Service", "Deployment", "PodDisruptionBudget", "HorizontalPodAutoscaler"]
    code, out, _ = run(capsys, "-f", production, "--config", config, "-a", names.MONITORING_GROUP_VERSION)
    assert [o["kind"] for o in yaml.safe_load_all(out)] == [*kinds, "ServiceMonitor", "PrometheusRule"]

    multinode = str(EXAMPLES / "kis-multinode.yaml")
    code, _, err = run(capsys, "-f", multinode, "--config", config)
    assert code == 1 and "refused (LeaderWorkerSetNotInstalled): spec.runtime.pipelineParallelSize" in err
    assert run(capsys, "-f", multinode, "--config", config, "-a", names.LWS_GROUP_VERSION)[0] == 0
    # the operator's own --no-leaderworkerset wins over what the cluster serves
    config = write_config(tmp_path, ["--no-leaderworkerset"])
    assert run(capsys, "-f", multinode, "--config", config, "-a", names.LWS_GROUP_VERSION)[0] == 1


def test_the_operators_flags_shape_the_objects(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_service(tmp_path, make_raw_spec())
    flags = ["--default-runtime-image=registry.local/kunlun/kunlun-runtime:0.1.0", "--no-xpu-health-gate"]
    flags += ["--preflight-xpu-smi", "/opt/xpu-smi", "--compatibility-configmap=kunlun/matrix"]
    code, out, err = run(capsys, "-f", path, "--config", write_config(tmp_path, flags))
    assert code == 0
    # no API server: the matrix ConfigMap cannot be read, and render says so
    assert err == (
        "kunlun-operator render: note: ConfigMap kunlun/matrix is not read (no API server): the packaged "
        "matrix is used, as when it is absent; give its matrix.yaml with --compatibility-matrix\n"
    )
    [deployment] = [o for o in yaml.safe_load_all(out) if o["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    # the packaged matrix's image, moved to the directory of --default-runtime-image
    assert pod["containers"][0]["image"].startswith("registry.local/kunlun/kunlun-runtime:")
    assert "readinessGates" not in pod
    assert {"name": "host-xpu-smi", "hostPath": {"path": "/opt/xpu-smi", "type": "File"}} in pod["volumes"]


def test_a_given_matrix_is_used_as_the_operator_would_use_its_configmap(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    matrix = tmp_path / "matrix.yaml"
    entry = {"runtime": "0.1.0", "image": "mirror.local/kunlun-runtime:0.1.0-kunlun"}
    entry.update({component: [version] for component, version in VERSIONS.items()})
    matrix.write_text(yaml.safe_dump({"entries": [entry]}))
    path = write_service(tmp_path, make_raw_spec())
    code, out, err = run(capsys, "-f", path, "--compatibility-matrix", str(matrix))
    assert (code, err) == (0, "")
    [deployment] = [o for o in yaml.safe_load_all(out) if o["kind"] == "Deployment"]
    assert (
        deployment["spec"]["template"]["spec"]["containers"][0]["image"]
        == "mirror.local/kunlun-runtime:0.1.0-kunlun"
    )


def test_namespaces_follow_the_file_then_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_service(tmp_path, make_raw_spec())
    namespaces = {o["metadata"]["namespace"] for o in yaml.safe_load_all(run(capsys, "-f", path)[1])}
    assert namespaces == {"default"}
    namespaces = {
        o["metadata"]["namespace"] for o in yaml.safe_load_all(run(capsys, "-f", path, "-n", "ml")[1])
    }
    assert namespaces == {"ml"}
    path = write_service(tmp_path, make_raw_spec(), namespace="prod")
    code, out, err = run(capsys, "-f", path, "-n", "ml")
    assert (code, out) == (1, "")
    assert err.endswith("document 1: metadata.namespace: 'prod' does not match --namespace 'ml'\n")


def test_files_that_are_not_what_render_reads_are_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    two = tmp_path / "two.yaml"
    two.write_text((EXAMPLES / "kis-minimal.yaml").read_text() + "---\napiVersion: v1\nkind: ConfigMap\n")
    code, out, err = run(capsys, "-f", str(two))
    assert (code, out) == (1, "")
    assert err == (
        f"kunlun-operator render: {two}: document 2: apiVersion, kind: want serving.kunlun.dev/v1alpha1, "
        "KunlunInferenceService; got ('v1', 'ConfigMap')\n"
    )
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    assert run(capsys, "-f", str(empty)) == (
        1,
        "",
        f"kunlun-operator render: {empty}: no KunlunInferenceService in it\n",
    )
    flags = tmp_path / "flags.yaml"
    flags.write_text("default-runtime-image: x\n")
    code, _, err = run(capsys, "-f", str(EXAMPLES / "kis-minimal.yaml"), "--config", str(flags))
    assert code == 1 and err.startswith(f"kunlun-operator render: {flags}: --config must be a YAML list")
    flags.write_text("[--no-such-flag]\n")
    with pytest.raises(SystemExit) as exit_:
        main(["render", "-f", str(EXAMPLES / "kis-minimal.yaml"), "--config", str(flags)])
    assert exit_.value.code == 2
    assert f"kunlun-operator render --config {flags}: error: unrecognized arguments: --no-such-flag" in (
        capsys.readouterr().err
    )
    missing = tmp_path / "no-policy.yaml"
    flags.write_text(yaml.safe_dump([f"--admission-policy={missing}"]))
    code, out, err = run(capsys, "-f", str(EXAMPLES / "kis-minimal.yaml"), "--config", str(flags))
    assert (code, out) == (1, "")  # a bad value in the flags file is said as coming from it
    assert err.startswith(f"kunlun-operator render --config {flags}: --admission-policy: [Errno 2]")


def test_the_dra_example_renders_pods_with_claims_and_no_extended_resource(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    example = str(EXAMPLES / "kis-dra.yaml")
    code, out, err = run(capsys, "-f", example, "--config", write_config(tmp_path, ["--dra"]), *EVERY_API)
    assert (code, err) == (0, "")
    objects = {o["kind"]: o for o in yaml.safe_load_all(out)}
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    template = objects["ResourceClaimTemplate"]["metadata"]["name"]
    assert pod["resourceClaims"] == [{"name": "xpus", "resourceClaimTemplateName": template}]
    assert names.RESOURCE_NAME not in json.dumps(pod["containers"] + pod["initContainers"])
    # without --dra (the default) the webhook refuses it, naming the field
    code, out, err = run(capsys, "-f", example, "--config", write_config(tmp_path, []), *EVERY_API)
    assert (code, out) == (1, "")
    assert (
        "is refused (DRANotEnabled): spec.resources.allocation: dra needs Dynamic Resource Allocation" in err
    )

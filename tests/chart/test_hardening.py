"""Hardening in the chart: device-plugin privileges per container, the admission policy reaching
the operator, the runtime NetworkPolicy, the labeler's ValidatingAdmissionPolicy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kunlun_operator import cli as operator_cli
from kunlun_operator.policy import AdmissionPolicy, parse_policy
from tests.chart.test_templates import PREFIX, containers, parse_cli
from tests.chart.tools import Rendered, render

HARDENED = {
    "privileged": False,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsUser": 0,
    "runAsNonRoot": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
PRIVILEGED = {"privileged": True, "runAsUser": 0, "runAsNonRoot": False, "readOnlyRootFilesystem": True}


def _validate(rendered: Rendered, kube_version: str, tmp_path: Path) -> str:
    path = tmp_path / "rendered.yaml"
    path.write_text(rendered.text)
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "kubernetes-validate"), "--strict", "-k", kube_version, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc.stdout + proc.stderr


def test_device_containers_are_privileged_only_for_xpu_smi_and_the_readers_can_drop_it(
    default_render: Rendered,
) -> None:
    by_name = containers(default_render, "DaemonSet", "-device-plugin")
    assert {name: c["securityContext"] for name, c in by_name.items()} == {
        "plugin": PRIVILEGED,
        "labeler": PRIVILEGED,
        "exporter": PRIVILEGED,
    }
    dev = {name: next(m for m in c["volumeMounts"] if m["name"] == "host-dev") for name, c in by_name.items()}
    assert {name: m.get("readOnly", False) for name, m in dev.items()} == {
        "plugin": False,
        "labeler": True,
        "exporter": True,
    }
    unprivileged = render(
        overrides={"devicePlugin": {"exporter": {"privileged": False}, "labeler": {"privileged": False}}}
    )
    by_name = containers(unprivileged, "DaemonSet", "-device-plugin")
    assert {name: c["securityContext"] for name, c in by_name.items()} == {
        "plugin": PRIVILEGED,
        "labeler": HARDENED,
        "exporter": HARDENED,
    }


def test_admission_policy_reaches_the_operator_as_a_file_it_parses(default_render: Rendered) -> None:
    policy = default_render.one("ConfigMap", "-operator-admission-policy")["data"]["policy.yaml"]
    assert parse_policy(policy, source="chart") == AdmissionPolicy(
        runtime_images=("ghcr.io/kunlun-inference/",)
    )
    operator = containers(default_render, "Deployment", "-operator")["operator"]
    args = parse_cli(operator_cli, operator["args"])
    assert args.admission_policy == "/etc/kunlun-operator/policy/policy.yaml"
    assert {
        "name": "admission-policy",
        "mountPath": "/etc/kunlun-operator/policy",
        "readOnly": True,
    } in operator["volumeMounts"]
    custom = render(
        overrides={
            "admissionPolicy": {"hostPaths": ["/data/models"], "modelImages": ["reg.example.com/models/"]}
        }
    )
    text = custom.one("ConfigMap", "-operator-admission-policy")["data"]["policy.yaml"]
    assert parse_policy(text, source="chart") == AdmissionPolicy(
        runtime_images=("ghcr.io/kunlun-inference/",),
        model_images=("reg.example.com/models/",),
        host_paths=("/data/models",),
    )
    annotation = "checksum/admission-policy"
    before = default_render.one("Deployment", "-operator")["spec"]["template"]["metadata"]["annotations"]
    after = custom.one("Deployment", "-operator")["spec"]["template"]["metadata"]["annotations"]
    assert before[annotation] != after[annotation]  # a policy change rolls the operator


def test_network_policy_is_off_by_default_and_admits_only_clients_and_prometheus(
    default_render: Rendered, tmp_path: Path
) -> None:
    assert default_render.all("NetworkPolicy") == []
    clients = [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}]
    on = render(
        overrides={"networkPolicy": {"enabled": True, "namespaces": ["ml", "chat"], "clients": clients}}
    )
    policies = on.all("NetworkPolicy")
    assert [p["metadata"]["namespace"] for p in policies] == ["ml", "chat"]
    assert policies[0]["spec"] == {
        "podSelector": {
            "matchLabels": {
                "app.kubernetes.io/name": "kunlun-runtime",
                "app.kubernetes.io/managed-by": "kunlun-operator",
            }
        },
        "policyTypes": ["Ingress"],
        "ingress": [
            {
                "ports": [{"port": 8000, "protocol": "TCP"}],
                "from": [
                    *clients,
                    {
                        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
                    },
                ],
            }
        ],
    }
    for version in ("1.28.0", "1.31.0"):
        out = _validate(on, version, tmp_path)
        assert "ERROR" not in out and out.count("passed for resource networkpolicy/") == 2, out


def test_labeler_node_restriction_policy_is_opt_in_and_valid_on_1_31(
    default_render: Rendered, tmp_path: Path
) -> None:
    assert default_render.all("ValidatingAdmissionPolicy") == []
    on = render(overrides={"devicePlugin": {"labeler": {"nodeRestrictionPolicy": True}}})
    policy = on.one("ValidatingAdmissionPolicy")
    assert policy["spec"]["matchConditions"][0]["expression"] == (
        f"request.userInfo.username == 'system:serviceaccount:kunlun-system:{PREFIX}-device-plugin'"
    )
    assert on.one("ValidatingAdmissionPolicyBinding")["spec"]["policyName"] == policy["metadata"]["name"]
    out = _validate(on, "1.31.0", tmp_path)
    assert "ERROR" not in out and out.count("passed for resource validatingadmissionpolicy") == 2, out

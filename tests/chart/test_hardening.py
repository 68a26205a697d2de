"""Hardening in the chart: device-plugin privileges per container, the admission policy reaching
the operator, the runtime NetworkPolicy, the labeler's ValidatingAdmissionPolicy."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

from kunlun_device import cli as device_cli
from kunlun_operator.policy.admission_policy import AdmissionPolicy, parse_policy
from kunlun_operator.shell import cli as operator_cli
from tests.chart.test_templates import PREFIX, containers, parse_cli
from tests.chart.tools import NAMESPACE, RELEASE, Rendered, render

UNPRIVILEGED = {
    "privileged": False,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
# the labeler runs as nobody; the exporter keeps uid 0 (no capabilities) for kubelet's root-owned
# pod-resources socket, which a client must be able to write to connect
LABELER = UNPRIVILEGED | {"runAsUser": 65534, "runAsGroup": 65534, "runAsNonRoot": True}
EXPORTER = UNPRIVILEGED | {"runAsUser": 0, "runAsNonRoot": False}
PRIVILEGED = {"privileged": True, "runAsUser": 0, "runAsNonRoot": False, "readOnlyRootFilesystem": True}
SNAPSHOT = "/run/kunlun-snapshot/node.json"
HOST_MOUNTS = {"host-dev", "host-sys", "kunlun-home", "xpu-smi"}


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


def test_only_the_plugin_is_privileged_and_the_readers_see_the_hardware_through_its_snapshot(
    default_render: Rendered,
) -> None:
    by_name = containers(default_render, "DaemonSet", "-device-plugin")
    assert {name: c["securityContext"] for name, c in by_name.items()} == {
        "plugin": PRIVILEGED,
        "labeler": LABELER,
        "exporter": EXPORTER,
    }
    mounts = {name: {m["name"]: m for m in c["volumeMounts"]} for name, c in by_name.items()}
    assert mounts["plugin"]["host-dev"] == {"name": "host-dev", "mountPath": "/host/dev"}
    assert mounts["plugin"]["node-snapshot"] == {"name": "node-snapshot", "mountPath": "/run/kunlun-snapshot"}
    for reader in ("labeler", "exporter"):
        assert not HOST_MOUNTS & set(mounts[reader])  # no /dev (nor /sys, xpu-smi) at all
        assert mounts[reader]["node-snapshot"] == {
            "name": "node-snapshot",
            "mountPath": "/run/kunlun-snapshot",
            "readOnly": True,
        }
    assert {m.get("readOnly", False) for r in ("labeler", "exporter") for m in mounts[r].values()} == {True}
    args = {name: parse_cli(device_cli, c["args"]) for name, c in by_name.items()}
    assert args["plugin"].snapshot_file == SNAPSHOT
    assert (args["labeler"].source, args["exporter"].source) == (f"snapshot:{SNAPSHOT}",) * 2
    volumes = {
        v["name"]: v
        for v in default_render.one("DaemonSet", "-device-plugin")["spec"]["template"]["spec"]["volumes"]
    }
    assert volumes["node-snapshot"] == {
        "name": "node-snapshot",
        "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"},
    }


def test_a_reader_opted_into_privileged_runs_xpu_smi_itself_with_dev_read_only() -> None:
    opted = render(
        overrides={
            "devicePlugin": {
                "exporter": {"privileged": True},
                "labeler": {"privileged": True},
                "hostPaths": {"xpuSmi": "/opt/kunlun/bin/xpu-smi"},
            }
        }
    )
    by_name = containers(opted, "DaemonSet", "-device-plugin")
    assert {name: c["securityContext"] for name, c in by_name.items()} == dict.fromkeys(by_name, PRIVILEGED)
    for reader in ("labeler", "exporter"):
        mounts = {m["name"]: m for m in by_name[reader]["volumeMounts"]}
        assert set(mounts) >= HOST_MOUNTS and "node-snapshot" not in mounts
        assert all(mounts[name]["readOnly"] for name in HOST_MOUNTS)
        args = parse_cli(device_cli, by_name[reader]["args"])
        assert (args.source, args.dev_root, args.xpu_smi) == ("xpu-smi", "/host", "/usr/local/bin/xpu-smi")
    mixed = containers(
        render(overrides={"devicePlugin": {"exporter": {"privileged": True}}}), "DaemonSet", "-device-plugin"
    )
    assert {name: c["securityContext"] for name, c in mixed.items()} == {
        "plugin": PRIVILEGED,
        "labeler": LABELER,
        "exporter": PRIVILEGED,
    }


def test_the_hardened_daemonset_is_valid_on_1_28_and_1_31(default_render: Rendered, tmp_path: Path) -> None:
    daemonset = default_render.one("DaemonSet", "-device-plugin")
    only = Rendered(text=yaml.safe_dump(daemonset), docs=(daemonset,))
    for version in ("1.28.0", "1.31.0"):
        out = _validate(only, version, tmp_path)
        assert "ERROR" not in out and out.count("passed for resource daemonset/") == 1, out


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


def test_checksum_annotations_are_strings_whatever_digits_the_hash_gives(
    rendered_sets: dict[str, Rendered],
) -> None:
    """A 16-digit hash prefix is hex; one in about 1,800 is all decimal digits and, unquoted, YAML
    reads it as an integer, which the API server refuses as an annotation (seen once in CI). The
    rendered text must quote it so its type does not depend on the hash."""
    for stem, rendered in rendered_sets.items():
        lines = [line.strip() for line in rendered.text.splitlines() if line.strip().startswith("checksum/")]
        assert lines, stem
        for line in lines:
            _, value = line.split(": ", 1)
            assert re.fullmatch(r'"[0-9a-f]{16}"', value), f"{stem}: {line}"
        for doc in rendered.docs:
            for field in ("annotations", "labels"):
                for meta in (
                    doc.get("metadata", {}),
                    doc.get("spec", {}).get("template", {}).get("metadata", {}),
                ):
                    values = (meta or {}).get(field) or {}
                    assert all(isinstance(v, str) for v in values.values()), f"{stem}: {field} {values}"


def test_network_policy_is_off_by_default_and_admits_only_clients_prometheus_and_the_operator(
    default_render: Rendered, tmp_path: Path
) -> None:
    """The operator is admitted on the runtime port (its LoRA load/unload calls); it creates these
    pods anyway, so this grants it nothing new."""
    assert default_render.all("NetworkPolicy") == []
    clients = [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}]
    on = render(
        overrides={"networkPolicy": {"enabled": True, "namespaces": ["ml", "chat"], "clients": clients}}
    )
    policies = on.all("NetworkPolicy")
    assert [p["metadata"]["namespace"] for p in policies] == ["ml", "chat"]
    operator_labels = {
        "app.kubernetes.io/name": "kunlun-inference",
        "app.kubernetes.io/instance": RELEASE,
        "app.kubernetes.io/component": "operator",
    }
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
            },
            {
                "ports": [{"port": 8000, "protocol": "TCP"}],
                "from": [
                    {
                        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}},
                        "podSelector": {"matchLabels": operator_labels},
                    }
                ],
            },
        ],
    }
    pod_labels = on.one("Deployment", "-operator")["spec"]["template"]["metadata"]["labels"]
    assert operator_labels.items() <= pod_labels.items()  # the selector picks the operator's pods
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


def test_namespaces_that_yaml_would_read_as_numbers_or_booleans_render_as_strings() -> None:
    """ "123" and "yes" are valid namespace names; unquoted, YAML reads them as an int and a bool,
    and the API server rejects the object."""
    namespaces = ["123", "yes", "ml"]
    rendered = render(
        overrides={
            "operator": {"watchNamespaces": namespaces, "rbac": {"apiKeySecrets": True}},
            "networkPolicy": {"enabled": True},
        }
    )
    seen = []
    for doc in rendered.docs:
        places = [doc.get("metadata", {}), *doc.get("subjects", [])]
        for place in places:
            if "namespace" in place:
                assert isinstance(place["namespace"], str), f"{doc['kind']}: {place['namespace']!r}"
                seen.append(place["namespace"])
    for namespace in namespaces:  # the peering, the API-key Role and binding, the NetworkPolicy
        assert seen.count(namespace) >= 4, (namespace, seen)

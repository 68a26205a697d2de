"""What the chart renders, object by object: the operator Deployment and its webhook, the device
plugin DaemonSet, Services and ServiceMonitors, the compatibility matrix, NOTES. Container
arguments are parsed by the components' own argparse parsers, so a flag the chart passes and the
program does not accept fails here, not in a cluster."""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from kunlun_device import cli as device_cli
from kunlun_operator.policy import matrix
from kunlun_operator.shell import cli as operator_cli
from kunlun_operator.spec.service import parse_spec
from tests.chart.tools import CHART, NAMESPACE, RELEASE, Rendered, helm, render

PREFIX = f"{RELEASE}-kunlun-inference"


def parse_cli(cli: ModuleType, args: list[str]) -> argparse.Namespace:
    """Parse `args` with the component's real parser; an unknown or bad flag fails the test."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            return cli.build_parser().parse_args(args)
        except SystemExit:
            pytest.fail(f"{cli.__name__} rejects the chart's arguments {args}: {stderr.getvalue()}")


def pod_spec(rendered: Rendered, kind: str, suffix: str) -> dict:
    return rendered.one(kind, suffix)["spec"]["template"]["spec"]


def containers(rendered: Rendered, kind: str, suffix: str) -> dict[str, dict]:
    return {c["name"]: c for c in pod_spec(rendered, kind, suffix)["containers"]}


# -- operator --------------------------------------------------------------------------------------


def test_operator_arguments_default(default_render: Rendered) -> None:
    operator = containers(default_render, "Deployment", "-operator")["operator"]
    assert operator["args"] == [
        "run",
        "--peering=kunlun-operator",
        "--liveness=http://0.0.0.0:8081/healthz",
        "--metrics-port=8080",
        "--log-level=info",
        "--xpu-health-gate-grace-seconds=120",
        "--all-namespaces",
        f"--compatibility-configmap={NAMESPACE}/{PREFIX}-compatibility",
        "--default-runtime-image=ghcr.io/kunlun-inference/kunlun-runtime:0.1.0",
        "--no-leaderworkerset",
        "--no-inference-pool",
        "--preflight-kml-version-file=/usr/local/xpu/kml/VERSION",
        "--admission-policy=/etc/kunlun-operator/policy/policy.yaml",
        "--webhook-port=9443",
        "--webhook-cert-dir=/etc/kunlun-operator/webhook",
    ]
    args = parse_cli(operator_cli, operator["args"])
    assert (args.command, args.all_namespaces, args.metrics_port, args.webhook_port) == (
        "run",
        True,
        8080,
        9443,
    )
    assert args.xpu_health_gate_grace_seconds == 120.0
    zero = containers(
        render(overrides={"operator": {"xpuHealthGateGraceSeconds": 0}}), "Deployment", "-operator"
    )
    assert parse_cli(operator_cli, zero["operator"]["args"]).xpu_health_gate_grace_seconds == 0.0


def test_preflight_host_files_follow_the_device_plugins_paths_unless_set() -> None:
    def preflight_args(overrides: dict) -> list[str]:
        operator = containers(render(overrides=overrides), "Deployment", "-operator")["operator"]
        return [a for a in operator["args"] if a.startswith("--preflight-")]

    # the device plugin's install directory and host xpu-smi (the labeler reads the same files)
    assert preflight_args(
        {"devicePlugin": {"hostPaths": {"kunlunHome": "/opt/xpu/", "xpuSmi": "/opt/xpu/bin/xpu-smi"}}}
    ) == [
        "--preflight-kml-version-file=/opt/xpu/kml/VERSION",
        "--preflight-xpu-smi=/opt/xpu/bin/xpu-smi",
    ]
    # set for the preflight alone
    own = {"runtime": {"preflight": {"kmlVersionFile": "/etc/kml.version", "xpuSmi": "/usr/sbin/xpu-smi"}}}
    assert preflight_args(own) == [
        "--preflight-kml-version-file=/etc/kml.version",
        "--preflight-xpu-smi=/usr/sbin/xpu-smi",
    ]
    # Pod Security baseline/restricted namespaces refuse hostPath: no node files at all
    off = {"runtime": {"preflight": {"hostMounts": False}}, "devicePlugin": {"hostPaths": {"xpuSmi": "/x"}}}
    assert preflight_args(off) == ["--preflight-kml-version-file="]


def test_operator_ha_runs_replicas_with_peering_spread_over_nodes(rendered_sets: dict[str, Rendered]) -> None:
    ha = rendered_sets["ha-values"]
    deployment = ha.one("Deployment", "-operator")
    assert deployment["spec"]["replicas"] == 3
    spec = deployment["spec"]["template"]["spec"]
    term = spec["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert (
        term["podAffinityTerm"]["labelSelector"]["matchLabels"]
        == deployment["spec"]["selector"]["matchLabels"]
    )
    assert spec["priorityClassName"] == "system-cluster-critical"
    args = parse_cli(operator_cli, spec["containers"][0]["args"])
    assert args.namespace == ["bank-prod", "bank-staging"] and not args.all_namespaces
    assert not args.standalone
    assert not ha.all("ClusterKopfPeering")  # namespaced kopf peers per served namespace
    assert [(p["metadata"]["namespace"], p["metadata"]["name"]) for p in ha.all("KopfPeering")] == [
        ("bank-prod", args.peering),
        ("bank-staging", args.peering),
    ]
    webhook = ha.one("ValidatingWebhookConfiguration")["webhooks"][0]
    assert webhook["namespaceSelector"] == {
        "matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["bank-prod", "bank-staging"]}
        ]
    }
    assert (webhook["failurePolicy"], webhook["timeoutSeconds"]) == ("Fail", 5)


def test_operator_pod_is_restricted_and_probed(default_render: Rendered) -> None:
    spec = pod_spec(default_render, "Deployment", "-operator")
    assert spec["securityContext"]["runAsNonRoot"] is True
    operator = spec["containers"][0]
    assert operator["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert operator["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert {p["name"]: p["containerPort"] for p in operator["ports"]} == {
        "metrics": 8080,
        "health": 8081,
        "webhook": 9443,
    }
    assert "affinity" not in spec  # one replica: nothing to spread
    args = parse_cli(operator_cli, operator["args"])
    assert default_render.one("ClusterKopfPeering")["metadata"]["name"] == args.peering
    assert not default_render.all("KopfPeering")


def test_webhook_disabled_removes_its_objects_and_turns_the_server_off() -> None:
    rendered = render(overrides={"operator": {"webhook": {"enabled": False}}})
    assert not rendered.all("ValidatingWebhookConfiguration")
    assert not [d for d in rendered.all("Secret")]
    assert [s["metadata"]["name"] for s in rendered.all("Service")] == [
        f"{PREFIX}-device-plugin-metrics",
        f"{PREFIX}-operator-metrics",
    ]
    args = parse_cli(operator_cli, containers(rendered, "Deployment", "-operator")["operator"]["args"])
    assert (args.webhook_port, args.webhook_cert_dir) == (0, None)


def test_webhook_routes_to_the_operator_with_a_certificate_its_ca_signs(
    default_render: Rendered, tmp_path: Path
) -> None:
    config = default_render.one("ValidatingWebhookConfiguration")["webhooks"][0]
    assert config["rules"] == [
        {
            "apiGroups": ["serving.kunlun.dev"],
            "apiVersions": ["v1alpha1"],
            "operations": ["CREATE", "UPDATE"],
            "resources": ["kunluninferenceservices"],
            "scope": "Namespaced",
        }
    ]
    service_ref = config["clientConfig"]["service"]
    assert service_ref == {
        "name": f"{PREFIX}-webhook",
        "namespace": NAMESPACE,
        "path": "/validate-kis",
        "port": 443,
    }
    service = default_render.one("Service", "-webhook")
    assert service["spec"]["ports"] == [
        {"name": "webhook", "port": 443, "targetPort": "webhook", "protocol": "TCP"}
    ]
    deployment = default_render.one("Deployment", "-operator")
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    secret = default_render.one("Secret", "-webhook-tls")
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["webhook-cert"]["secret"]["secretName"] == secret["metadata"]["name"]
    assert secret["data"]["ca.crt"] == config["clientConfig"]["caBundle"]
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl not installed: certificate chain not verified")
    for key in ("ca.crt", "tls.crt"):
        (tmp_path / key).write_bytes(base64.b64decode(secret["data"][key]))
    verify = subprocess.run(
        [openssl, "verify", "-CAfile", "ca.crt", "tls.crt"], cwd=tmp_path, capture_output=True, text=True
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    text = subprocess.run(
        [openssl, "x509", "-in", "tls.crt", "-noout", "-ext", "subjectAltName"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert f"DNS:{PREFIX}-webhook.{NAMESPACE}.svc" in text


# -- device plugin ---------------------------------------------------------------------------------


def test_device_plugin_daemonset_runs_three_containers_with_their_host_paths(
    default_render: Rendered,
) -> None:
    spec = pod_spec(default_render, "DaemonSet", "-device-plugin")
    assert spec["priorityClassName"] == "system-node-critical"
    assert spec["tolerations"] == [{"operator": "Exists"}]
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert [t["matchExpressions"][0]["key"] for t in terms] == [
        "feature.node.kubernetes.io/pci-1d22.present",
        "kunlun.dev/xpu.present",
    ]
    volumes = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    assert volumes == {
        "device-plugins": "/var/lib/kubelet/device-plugins",
        "pod-resources": "/var/lib/kubelet/pod-resources",
        "host-dev": "/dev",
        "host-sys": "/sys",
        "kunlun-home": "/usr/local/xpu",
        "plugin-state": "/var/lib/kunlun-device-plugin",
    }
    assert [v for v in spec["volumes"] if "hostPath" not in v] == [
        {"name": "fault-state", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
        {"name": "node-snapshot", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
    ]
    by_name = {c["name"]: c for c in spec["containers"]}
    assert list(by_name) == ["plugin", "labeler", "exporter"]
    mounts = {name: {m["mountPath"] for m in c["volumeMounts"]} for name, c in by_name.items()}
    host = {"/host/dev", "/host/sys", "/host/usr/local/xpu"}
    snapshot = "/run/kunlun-snapshot"
    assert mounts == {
        "plugin": host
        | {"/var/lib/kubelet/device-plugins", "/var/lib/kubelet/pod-resources", "/run/kunlun", snapshot}
        | {"/var/lib/kunlun-device-plugin"},
        "labeler": {snapshot},  # the hardware only through the plugin's snapshot
        "exporter": {"/var/lib/kubelet/pod-resources", "/run/kunlun", snapshot},
    }
    for name, container in by_name.items():
        assert container["env"] == [
            {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
        ]
        args = parse_cli(device_cli, container["args"])
        assert args.command == name
    plugin = parse_cli(device_cli, by_name["plugin"]["args"])
    assert (plugin.dev_root, plugin.xpu_smi) == ("/host", "/usr/local/bin/xpu-smi")
    assert plugin.snapshot_file == f"{snapshot}/node.json"
    for reader in ("labeler", "exporter"):
        assert parse_cli(device_cli, by_name[reader]["args"]).source == f"snapshot:{snapshot}/node.json"
    assert plugin.kubelet_dir == "/var/lib/kubelet/device-plugins"
    assert (
        plugin.respond_to_faults,
        plugin.pod_resources_socket,
        plugin.quarantine_failures,
        plugin.quarantine_window_seconds,
        plugin.node_sync_seconds,
        plugin.quarantine_file,
        plugin.state_file,
        plugin.taint_when_all_unhealthy,
    ) == (
        True,
        "/var/lib/kubelet/pod-resources/kubelet.sock",
        3,
        600,
        30,
        "/run/kunlun/quarantine.json",
        "/var/lib/kunlun-device-plugin/state.json",  # on the plugin-state hostPath: outlives the pod
        False,
    )
    exporter = parse_cli(device_cli, by_name["exporter"]["args"])
    assert exporter.quarantine_file == plugin.quarantine_file
    assert (exporter.port, exporter.pod_resources_socket) == (
        9400,
        "/var/lib/kubelet/pod-resources/kubelet.sock",
    )
    assert by_name["exporter"]["ports"] == [{"name": "metrics", "containerPort": 9400, "protocol": "TCP"}]


def test_custom_node_selector_replaces_the_default_affinity(rendered_sets: dict[str, Rendered]) -> None:
    rendered = rendered_sets["nodeselector-values"]
    spec = pod_spec(rendered, "DaemonSet", "-device-plugin")
    assert spec["nodeSelector"] == {"accelerator": "kunlun-p800"}
    assert "affinity" not in spec
    assert spec["tolerations"] == [{"key": "kunlunxin.com/xpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert spec["imagePullSecrets"] == [{"name": "mirror-pull"}]
    by_name = {c["name"]: c for c in spec["containers"]}
    assert list(by_name) == ["plugin", "labeler"]  # exporter disabled
    assert {"name": "xpu-smi", "mountPath": "/usr/local/bin/xpu-smi", "readOnly": True} in by_name["plugin"][
        "volumeMounts"
    ]
    assert {v["name"]: v["hostPath"] for v in spec["volumes"] if "hostPath" in v}["xpu-smi"] == {
        "path": "/opt/kunlun/bin/xpu-smi",
        "type": "File",
    }
    assert parse_cli(device_cli, by_name["labeler"]["args"]).interval == 60
    assert not [
        s for s in rendered.all("Service") if s["metadata"]["name"].endswith("-device-plugin-metrics")
    ]
    operator = pod_spec(rendered, "Deployment", "-operator")
    assert operator["nodeSelector"] == {"node-role.kubernetes.io/system": "true"}
    assert operator["containers"][0]["image"].startswith("registry.bank.internal/mirror/kunlun-inference/")


def test_device_plugin_can_be_left_out() -> None:
    rendered = render(overrides={"devicePlugin": {"enabled": False}})
    assert not rendered.all("DaemonSet")
    assert not [d for d in rendered.docs if d["metadata"]["name"].startswith(f"{PREFIX}-device-plugin")]


# -- monitoring wiring ------------------------------------------------------------------------------


def test_service_monitors_select_services_and_ports_that_exist(monitoring_render: Rendered) -> None:
    services = monitoring_render.all("Service")
    for monitor in monitoring_render.all("ServiceMonitor"):
        wanted = monitor["spec"]["selector"]["matchLabels"]
        matched = [
            s
            for s in services
            if wanted.items() <= s["metadata"]["labels"].items()
            and "metrics" in {p["name"] for p in s["spec"]["ports"]}
        ]
        assert len(matched) == 1, monitor["metadata"]["name"]
        assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
        assert monitor["spec"]["endpoints"][0]["interval"] == "15s"
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        assert matched[0]["spec"]["selector"].items() <= pod_labels(monitoring_render, matched[0]).items()


def pod_labels(rendered: Rendered, service: dict) -> dict:
    for kind in ("Deployment", "DaemonSet"):
        for workload in rendered.all(kind):
            labels = workload["spec"]["template"]["metadata"]["labels"]
            if service["spec"]["selector"].items() <= labels.items():
                return labels
    raise AssertionError(f"service {service['metadata']['name']} selects no pod")


# -- compatibility matrix and NOTES ------------------------------------------------------------------


def test_compatibility_configmap_parses_with_the_operators_own_parser(
    rendered_sets: dict[str, Rendered],
) -> None:
    text = rendered_sets["ha-values"].one("ConfigMap", "-compatibility")["data"][matrix.MATRIX_KEY]
    parsed = matrix.parse_matrix(text, source="chart ConfigMap")
    assert [(e.runtime, sorted(e.driver)) for e in parsed.entries] == [
        ("0.1.0", ["5.0.21.26"]),
        ("0.1.0", ["5.0.22"]),
    ]


def test_notes_print_a_first_model_the_crd_and_the_matrix_accept() -> None:
    proc = helm("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client")
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert f"rollout status deployment/{PREFIX}-operator" in notes
    assert f"helm test {RELEASE} -n {NAMESPACE}" in notes
    block = notes.split("kubectl apply -f -\n", 1)[1].split("     YAML\n", 1)[0]
    cr = yaml.safe_load("\n".join(line[5:] for line in block.splitlines()))
    assert cr["kind"] == "KunlunInferenceService"
    spec = parse_spec(cr["spec"])
    image = "ghcr.io/kunlun-inference/kunlun-runtime:0.1.0"
    assert matrix.check_versions(matrix.load_default_matrix(), image, spec.versions) == []

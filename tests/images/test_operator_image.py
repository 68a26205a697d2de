"""The operator image against the fake Kubernetes API on the host: it starts, serves its liveness
endpoint and reconciles a KunlunInferenceService into a Deployment."""

from __future__ import annotations

import copy
import urllib.request
from pathlib import Path

import pytest

from tests.images.conftest import Podman, free_port
from tests.integration.operator.conftest import TEST_POLICY, Cluster
from tests.support import waiting
from tests.support.kubeapi import running_fake_api

pytestmark = pytest.mark.slow
SPEC = {
    "model": {"name": "qwen", "source": {"hostPath": {"path": "/data/qwen"}}, "parameters": "7B"},
    "versions": {"driver": "5.0.21.26", "firmware": "1.0.2.14.1.54", "kml": "3.2.0"},
}


def live(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def test_the_operator_image_reconciles_a_service(
    podman: Podman, operator_image: str, tmp_path: Path, container: list[str]
) -> None:
    policy = tmp_path / "admission-policy.yaml"
    policy.write_text(TEST_POLICY)
    health, webhook = free_port(), free_port()
    with running_fake_api(tmp_path) as kube:
        cluster = Cluster(kube, tmp_path)
        cluster.add_node("xpu-1")
        name = podman.container_name("operator")
        container.append(name)
        podman(
            "run", "--detach", "--name", name, "--network", "host", "--read-only",
            "--volume", f"{kube.kubeconfig}:/etc/kunlun/kubeconfig.json:ro",
            "--volume", f"{policy}:/etc/kunlun/admission-policy.yaml:ro",
            "--env", "KUBECONFIG=/etc/kunlun/kubeconfig.json",
            operator_image,
            "run", "--standalone", "--all-namespaces", "--metrics-port", "0",
            "--liveness", f"http://127.0.0.1:{health}/healthz", "--webhook-port", str(webhook),
            "--admission-policy", "/etc/kunlun/admission-policy.yaml",
        )  # fmt: skip
        try:
            waiting.wait_for(
                lambda: live(health), timeout_seconds=60, message="liveness", interval_seconds=0.2
            )
            cluster.create_service(copy.deepcopy(SPEC))
            deployment = waiting.wait_for(
                cluster.deployment, timeout_seconds=60, message="the Deployment", interval_seconds=0.2
            )
            # The first pass may report Pending (it read the namespace before its Deployment
            # existed); the pass the Deployment's creation triggers reports Progressing.
            seen: list[str | None] = []

            def progressing() -> bool:
                seen.append(cluster.status().get("phase"))
                return seen[-1] == "Progressing"

            waiting.wait_for(
                progressing, timeout_seconds=60, message="phase Progressing", interval_seconds=0.2
            )
            phase = seen[-1]
        except AssertionError:
            print(podman("logs", name, check=False).stderr)
            raise
        assert podman("exec", name, "id", "-u").stdout.strip() == "10001"
    assert deployment is not None
    assert deployment["metadata"]["namespace"] == "ml"
    assert deployment["spec"]["template"]["spec"]["containers"][0]["name"] == "runtime"
    assert phase == "Progressing"
    assert set(seen) <= {None, "Pending", "Progressing"}, seen

"""Fixtures for operator integration tests: the fake API, the real operator as a subprocess.

The operator runs as ``python -m kunlun_operator.shell.cli run`` (what the console script runs) with
``KUBECONFIG`` pointing at the fake API, short watch timeouts and retry delays, so that no test
waits for wall-clock periods: tests poll for the state they expect, with a deadline.
"""

from __future__ import annotations

import datetime
import functools
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from tests.support import waiting
from tests.support.kubeapi import RunningKubeAPI, running_fake_api

GROUP, VERSION, PLURAL = "serving.kunlun.dev", "v1alpha1", "kunluninferenceservices"
LWS_GROUP = "leaderworkerset.x-k8s.io"
NAMESPACE = "ml"
DEADLINE_SECONDS = 30
#: The admission policy the tests' operators run with unless a test passes its own: the scenarios'
#: models live under /data on the host.
TEST_POLICY = "runtimeImages: [ghcr.io/kunlun-inference/]\nhostPaths: [/data]\n"
VERSION_LABELS = {
    "kunlun.dev/xpu.present": "true",
    "kunlun.dev/xpu.product": "P800",
    "kunlun.dev/xpu.count": "8",
    "kunlun.dev/xpu.driver-version": "5.0.21.26",
    "kunlun.dev/xpu.firmware-version": "1.0.2.14.1.54",
    "kunlun.dev/xpu.kml-version": "3.2.0",
}


RUNTIME_POD_LABELS = {  # what the Deployment's template gives the runtime pods
    "app.kubernetes.io/name": "kunlun-runtime",
    "app.kubernetes.io/instance": "qwen",
    "app.kubernetes.io/component": "inference",
    "app.kubernetes.io/part-of": "kunlun-inference",
    "app.kubernetes.io/managed-by": "kunlun-operator",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# How this suite waits: the shared poller with the suite's deadline, an API error (the fake API
# injects faults) counting as "not yet".
wait_for = functools.partial(
    waiting.wait_for, timeout_seconds=DEADLINE_SECONDS, ignoring=(kubernetes.client.ApiException,)
)


@dataclass
class OperatorProcess:
    process: subprocess.Popen[bytes]
    log_path: Path
    webhook_port: int

    def log(self) -> str:
        return self.log_path.read_text()

    def kill(self) -> None:
        """SIGKILL: no cleanup, as a crash or an evicted pod."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class Cluster:
    """The fake API plus official-client shortcuts the tests use."""

    kube: RunningKubeAPI
    tmp_path: Path

    def __post_init__(self) -> None:
        client = self.kube.client()
        self.core = kubernetes.client.CoreV1Api(client)
        self.apps = kubernetes.client.AppsV1Api(client)
        self.custom = kubernetes.client.CustomObjectsApi(client)
        self.operators: list[OperatorProcess] = []

    def start_operator(self, *extra: str, standalone: bool = True) -> OperatorProcess:
        health, webhook = free_port(), free_port()
        log_path = self.tmp_path / f"operator-{len(self.operators)}.log"
        if "--admission-policy" not in extra:
            policy = self.tmp_path / "admission-policy.yaml"
            policy.write_text(TEST_POLICY)
            extra = ("--admission-policy", str(policy), *extra)
        args = [
            sys.executable,
            "-m",
            "kunlun_operator.shell.cli",
            "run",
            *(["--standalone"] if standalone else []),
            "--metrics-port",
            "0",
            "--liveness",
            f"http://127.0.0.1:{health}/healthz",
            "--webhook-port",
            str(webhook),
            "--resync-seconds",
            "3600",
            "--retry-delay",
            "0.1",
            "--watch-timeout",
            "5",
            *extra,
        ]
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "KUBECONFIG": str(self.kube.kubeconfig), "PYTHONUNBUFFERED": "1"},
            )
        operator = OperatorProcess(process, log_path, webhook)
        self.operators.append(operator)

        def healthy() -> bool:
            assert process.poll() is None, f"the operator exited:\n{operator.log()}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{health}/healthz", timeout=1) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_for(healthy, message="the operator's liveness endpoint")
        return operator

    def add_node(self, name: str, **labels: str) -> None:
        self.core.create_node({"metadata": {"name": name, "labels": {**VERSION_LABELS, **labels}}})

    def create_service(self, spec: dict[str, Any], name: str = "qwen") -> dict[str, Any]:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "KunlunInferenceService",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": spec,
        }
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, body)

    def get_service(self, name: str = "qwen") -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name)

    def patch_service(self, patch: dict[str, Any], name: str = "qwen") -> dict[str, Any]:
        return self.custom.patch_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name, patch)

    def status(self, name: str = "qwen") -> dict[str, Any]:
        return self.get_service(name).get("status") or {}

    def condition(self, type_: str, name: str = "qwen") -> tuple[str, str, str] | None:
        for c in self.status(name).get("conditions") or []:
            if c["type"] == type_:
                return c["status"], c["reason"], c["message"]
        return None

    def deployment(self, name: str = "qwen") -> dict[str, Any] | None:
        found = [d for d in self.kube.objects("deployments", "apps") if d["metadata"]["name"] == name]
        return found[0] if found else None

    def mark_deployment_ready(self, name: str = "qwen", ready: int = 1) -> None:
        """Play the Deployment controller: report ``ready`` replicas of the current template."""
        deployment = self.apps.read_namespaced_deployment(name, NAMESPACE)
        replicas = deployment.spec.replicas or 1
        self.apps.patch_namespaced_deployment_status(
            name,
            NAMESPACE,
            {
                "status": {
                    "observedGeneration": deployment.metadata.generation,
                    "replicas": replicas,
                    "readyReplicas": ready,
                    "updatedReplicas": replicas,
                    "availableReplicas": ready,
                    "conditions": [
                        {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"}
                    ],
                }
            },
        )

    def leaderworkerset(self, name: str = "qwen-lws") -> dict[str, Any] | None:
        found = [o for o in self.kube.objects("leaderworkersets", LWS_GROUP) if o["metadata"]["name"] == name]
        return found[0] if found else None

    def patch_leaderworkerset(self, patch: dict[str, Any], name: str = "qwen-lws", **kwargs: Any) -> None:
        self.custom.patch_namespaced_custom_object(
            LWS_GROUP, "v1", NAMESPACE, "leaderworkersets", name, patch, **kwargs
        )

    def mark_leaderworkerset_ready(self, name: str = "qwen-lws") -> None:
        """Play the LeaderWorkerSet controller: every group of the current template ready."""
        lws = self.custom.get_namespaced_custom_object(LWS_GROUP, "v1", NAMESPACE, "leaderworkersets", name)
        replicas = lws["spec"]["replicas"]
        status = {
            "observedGeneration": lws["metadata"]["generation"],
            "replicas": replicas,
            "readyReplicas": replicas,
            "updatedReplicas": replicas,
        }
        self.custom.patch_namespaced_custom_object_status(
            LWS_GROUP, "v1", NAMESPACE, "leaderworkersets", name, {"status": status}
        )

    def event_reasons(self) -> list[str]:
        return [e.get("reason") for e in self.kube.objects("events")]

    def wait_for_events(self, reason: str, count: int = 1) -> None:
        """Events are posted in the background by kopf: wait until ``count`` of ``reason`` arrived."""
        wait_for(lambda: self.event_reasons().count(reason) >= count, message=f"{count} {reason} event(s)")
        assert self.event_reasons().count(reason) == count


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    monitoring = request.node.get_closest_marker("monitoring") is not None
    leaderworkerset = request.node.get_closest_marker("leaderworkerset") is not None
    routing = request.node.get_closest_marker("routing") is not None
    with running_fake_api(
        tmp_path, monitoring=monitoring, leaderworkerset=leaderworkerset, routing=routing
    ) as kube:
        cluster = Cluster(kube, tmp_path)
        try:
            yield cluster
        finally:
            for operator in cluster.operators:
                operator.stop()
            if request.node.rep_call.failed if hasattr(request.node, "rep_call") else False:
                for operator in cluster.operators:
                    print(f"--- {operator.log_path.name} ---\n{operator.log()}")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "monitoring: the fake API also serves monitoring.coreos.com/v1")
    config.addinivalue_line(
        "markers", "leaderworkerset: the fake API also serves leaderworkerset.x-k8s.io/v1 (LeaderWorkerSet)"
    )
    config.addinivalue_line(
        "markers",
        "routing: the fake API also serves inference.networking.k8s.io/v1 (InferencePool) and "
        "gateway.networking.k8s.io/v1 (HTTPRoute)",
    )


def add_failed_pod(cluster: Cluster, name: str = "qwen-7d9f-abcde") -> None:
    """A runtime pod on xpu-1 whose card 5 the node agent has just declared unhealthy."""
    pod = {
        "metadata": {"name": name, "labels": RUNTIME_POD_LABELS},
        "spec": {"nodeName": "xpu-1", "containers": []},
    }
    cluster.core.create_namespaced_pod(NAMESPACE, pod)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    condition = {
        "type": "kunlun.dev/xpu-healthy",
        "status": "False",
        "reason": "XpuUnhealthy",
        "message": "node xpu-1: xpu5 (KL-0005): ecc-uncorrectable: 3 uncorrectable ECC errors",
        "lastTransitionTime": now,
    }
    cluster.core.patch_namespaced_pod_status(name, NAMESPACE, {"status": {"conditions": [condition]}})

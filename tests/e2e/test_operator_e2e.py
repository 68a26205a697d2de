"""The operator on a real cluster (``KUBECONFIG``): the integration scenarios plus what only a real
API server does (CRD defaulting, CEL validation, printer columns, garbage collection).

Skipped without ``KUBECONFIG``. ``tests/e2e/kind-setup.sh`` makes a suitable kind cluster. The
tests install the CRD, run ``kunlun-operator`` locally against the cluster for one fresh namespace,
and leave the cluster as they found it (namespace deleted, node labels restored).
"""

from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys
import types
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from tests.support import waiting

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not os.environ.get("KUBECONFIG") or not Path(os.environ["KUBECONFIG"]).exists(),
        reason="e2e needs a real cluster: set KUBECONFIG (tests/e2e/kind-setup.sh makes one)",
    ),
]
T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[2]
GROUP, VERSION, PLURAL = "serving.kunlun.dev", "v1alpha1", "kunluninferenceservices"
DRIVER_LABEL = "kunlun.dev/xpu.driver-version"
EMPTY = types.SimpleNamespace(conditions=None)  # a CRD status not written yet
SPEC = {
    "model": {"name": "qwen", "source": {"hostPath": {"path": "/data/qwen"}}, "parameters": "135M"},
    "versions": {"driver": "5.0.21.26", "firmware": "1.0.2.14.1.54", "kml": "3.2.0"},
}


# How these tests wait: the shared poller, gently (a real API server), with a minute's deadline.
wait_for = functools.partial(waiting.wait_for, timeout_seconds=60, interval_seconds=0.5)


class E2E:
    def __init__(self) -> None:
        import kubernetes  # imported here: the client reads KUBECONFIG when it is configured

        self.k8s = kubernetes
        self.client = kubernetes.config.new_client_from_config(config_file=os.environ["KUBECONFIG"])
        self.core = kubernetes.client.CoreV1Api(self.client)
        self.apps = kubernetes.client.AppsV1Api(self.client)
        self.custom = kubernetes.client.CustomObjectsApi(self.client)
        self.ext = kubernetes.client.ApiextensionsV1Api(self.client)
        self.namespace = f"kunlun-e2e-{uuid.uuid4().hex[:6]}"
        self.node = ""  # a Kunlun-labelled node, and its driver label to restore
        self.node_driver: str | None = None

    def not_found(self, call: Callable[[], Any]) -> bool:
        try:
            call()
        except self.k8s.client.ApiException as e:
            return e.status == 404
        return False

    def read(self, call: Callable[..., T], *args: Any) -> T | None:
        """``call(*args)``, or None when it answers 404."""
        try:
            return call(*args)
        except self.k8s.client.ApiException as e:
            if e.status == 404:
                return None
            raise

    def install_crd(self) -> None:
        with (ROOT / "crds" / "serving.kunlun.dev_kunluninferenceservices.yaml").open() as f:
            crd = yaml.safe_load(f)
        name = crd["metadata"]["name"]
        if self.not_found(lambda: self.ext.read_custom_resource_definition(name)):
            self.ext.create_custom_resource_definition(crd)
        else:
            self.ext.patch_custom_resource_definition(name, {"spec": crd["spec"]})
        wait_for(
            lambda: any(
                c.type == "Established" and c.status == "True"
                for c in self.ext.read_custom_resource_definition(name).status.conditions or []
            ),
            message="the CRD established",
        )

    def service(self, name: str = "qwen") -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name)

    def status(self, name: str = "qwen") -> dict[str, Any]:
        return self.service(name).get("status") or {}

    def create(self, spec: dict[str, Any], name: str = "qwen") -> dict[str, Any]:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "KunlunInferenceService",
            "metadata": {"name": name},
            "spec": spec,
        }
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, body)


@pytest.fixture(scope="module")
def e2e(tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2E]:
    env = E2E()
    env.install_crd()
    env.core.create_namespace({"metadata": {"name": env.namespace}})
    kunlun = env.core.list_node(label_selector="kunlun.dev/xpu.present=true").items
    if not kunlun:
        pytest.skip("no node labelled kunlun.dev/xpu.present=true (run tests/e2e/kind-setup.sh)")
    env.node = kunlun[0].metadata.name
    env.node_driver = kunlun[0].metadata.labels.get(DRIVER_LABEL)
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kunlun_operator.shell.cli",
                "run",
                "--standalone",
                "--namespace",
                env.namespace,
                "--metrics-port",
                "0",
                "--liveness",
                "",
                "--webhook-port",
                "0",
                "--retry-delay",
                "0.5",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        yield env
    finally:
        env.core.patch_node(env.node, {"metadata": {"labels": {DRIVER_LABEL: env.node_driver}}})
        for item in env.custom.list_namespaced_custom_object(GROUP, VERSION, env.namespace, PLURAL)["items"]:
            env.custom.delete_namespaced_custom_object(
                GROUP, VERSION, env.namespace, PLURAL, item["metadata"]["name"]
            )
        wait_for(
            lambda: (
                not env.custom.list_namespaced_custom_object(GROUP, VERSION, env.namespace, PLURAL)["items"]
            ),
            message="services deleted",
        )
        process.terminate()
        process.wait(30)
        env.core.delete_namespace(env.namespace)
        print(log.read_text())


def test_the_api_server_rejects_an_invalid_service_naming_the_field(e2e: E2E) -> None:
    bad = {**copy.deepcopy(SPEC), "resources": {"xpus": 3}, "runtime": {"tensorParallelSize": 2}}
    with pytest.raises(e2e.k8s.client.ApiException) as raised:
        e2e.create(bad, name="bad")
    assert raised.value.status == 422
    assert "spec.resources.xpus" in raised.value.body


def test_create_defaults_the_spec_and_builds_the_objects(e2e: E2E) -> None:
    created = e2e.create(copy.deepcopy(SPEC))
    assert created["spec"]["versions"]["policy"] == "Strict"  # CRD defaulting
    assert created["spec"]["resources"] == {"xpus": 1}
    wait_for(lambda: e2e.status().get("compatibleNodes", 0) >= 1, message="the status")
    deployment = wait_for(
        lambda: e2e.read(e2e.apps.read_namespaced_deployment, "qwen", e2e.namespace), message="the Deployment"
    )
    assert deployment.metadata.owner_references[0].uid == created["metadata"]["uid"]
    assert e2e.core.read_namespaced_service("qwen", e2e.namespace)
    assert e2e.core.read_namespaced_config_map("qwen-config", e2e.namespace)
    assert e2e.status()["phase"] in ("Pending", "Progressing")


def test_spec_change_rolls_the_pod_template(e2e: E2E) -> None:
    def config_hash() -> str | None:
        d = e2e.read(e2e.apps.read_namespaced_deployment, "qwen", e2e.namespace)
        return d.spec.template.metadata.annotations["serving.kunlun.dev/config-hash"] if d else None

    before = wait_for(config_hash, message="the Deployment")
    e2e.custom.patch_namespaced_custom_object(
        GROUP, VERSION, e2e.namespace, PLURAL, "qwen", {"spec": {"runtime": {"maxModelLen": 2048}}}
    )
    wait_for(lambda: config_hash() != before, message="a new config hash")


def test_deleted_service_is_restored(e2e: E2E) -> None:
    service = wait_for(
        lambda: e2e.read(e2e.core.read_namespaced_service, "qwen", e2e.namespace), message="the Service"
    )
    old = service.metadata.uid
    e2e.core.delete_namespaced_service("qwen", e2e.namespace)
    wait_for(
        lambda: (
            not e2e.not_found(lambda: e2e.core.read_namespaced_service("qwen", e2e.namespace))
            and e2e.core.read_namespaced_service("qwen", e2e.namespace).metadata.uid != old
        ),
        message="the Service back",
    )


def test_node_label_change_is_reported(e2e: E2E) -> None:
    before = e2e.status()["compatibleNodes"]
    e2e.core.patch_node(e2e.node, {"metadata": {"labels": {DRIVER_LABEL: "0.0.0"}}})
    wait_for(lambda: e2e.status()["compatibleNodes"] == before - 1, message="one compatible node fewer")
    e2e.core.patch_node(e2e.node, {"metadata": {"labels": {DRIVER_LABEL: e2e.node_driver}}})
    wait_for(lambda: e2e.status()["compatibleNodes"] == before, message="the node back")


LWS_CRD = "leaderworkersets.leaderworkerset.x-k8s.io"
LWS_GROUP = "leaderworkerset.x-k8s.io"


def test_a_multi_node_service_is_a_leaderworkerset_the_api_server_accepts(e2e: E2E) -> None:
    """Skipped unless the cluster has LeaderWorkerSet (``LWS_VERSION=... tests/e2e/kind-setup.sh``):
    the real LWS admission and CRD validate what the operator builds; LWS makes its own headless
    Service for the group's DNS beside ours; deleting the service removes the LeaderWorkerSet."""
    if e2e.read(e2e.ext.read_custom_resource_definition, LWS_CRD) is None:
        pytest.skip("the cluster has no LeaderWorkerSet (LWS_VERSION=v0.8.0 tests/e2e/kind-setup.sh)")
    spec = {**copy.deepcopy(SPEC), "runtime": {"pipelineParallelSize": 2}}
    created = e2e.create(spec, name="multi")
    assert created["spec"]["runtime"]["tensorParallelSize"] == 1  # CRD defaulting

    def lws() -> dict[str, Any] | None:
        return e2e.read(
            e2e.custom.get_namespaced_custom_object,
            LWS_GROUP,
            "v1",
            e2e.namespace,
            "leaderworkersets",
            "multi-lws",
        )

    group = wait_for(lws, message="the LeaderWorkerSet")
    assert group["metadata"]["ownerReferences"][0]["uid"] == created["metadata"]["uid"]
    assert group["spec"]["leaderWorkerTemplate"]["size"] == 2
    # LWS's headless Service (named like the LWS, for LWS_LEADER_ADDRESS) and ours, selecting leaders
    wait_for(
        lambda: e2e.read(e2e.core.read_namespaced_service, "multi-lws", e2e.namespace),
        message="LWS's Service",
    )
    ours = e2e.core.read_namespaced_service("multi", e2e.namespace)
    assert ours.spec.selector["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    assert e2e.read(e2e.apps.read_namespaced_deployment, "multi", e2e.namespace) is None
    e2e.custom.delete_namespaced_custom_object(GROUP, VERSION, e2e.namespace, PLURAL, "multi")
    wait_for(lambda: lws() is None, message="the LeaderWorkerSet gone")


def test_deleting_the_service_removes_what_it_owns(e2e: E2E) -> None:
    e2e.custom.delete_namespaced_custom_object(GROUP, VERSION, e2e.namespace, PLURAL, "qwen")
    wait_for(
        lambda: e2e.not_found(lambda: e2e.apps.read_namespaced_deployment("qwen", e2e.namespace)),
        message="the Deployment gone",
    )
    wait_for(
        lambda: e2e.not_found(lambda: e2e.core.read_namespaced_config_map("qwen-config", e2e.namespace)),
        message="the ConfigMap gone",
    )

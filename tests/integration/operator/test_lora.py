"""LoRA adapters on a real ``kunlun-runtime serve``, started as the operator's pod would start it.

The runtime container's command and arguments come from the operator's pod builder for a service
with ``runtimeUpdates``; the test plays the kubelet (``$$`` → ``$``, the ConfigMap's
``lora-modules`` file, the volumes at their mount paths) so the shell wrapper itself starts the
runtime with the ConfigMap's adapters. Then the operator's ``AdapterSyncer`` loads, replaces and
unloads adapters on it through the real API, and reports what the runtime refuses.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from kunlun_operator import names
from kunlun_operator.builders.adapters import LORA_MODULES_FILE, AdapterMount, adapter_mounts
from kunlun_operator.builders.configmap import build_config_data
from kunlun_operator.builders.pod_template import build_pod_spec, model_path
from kunlun_operator.decide.adapters import AdapterOutcome, AdapterPod, AdapterState
from kunlun_operator.shell.controller import Controller, ControllerConfig
from kunlun_operator.shell.kube import KubeClient
from kunlun_operator.shell.metrics import OperatorMetrics
from kunlun_operator.shell.pod_adapters import AdapterSyncer
from kunlun_operator.spec.service import parse_spec
from kunlun_operator.spec.values import InferenceSpec
from tests.integration.server.live import free_port, health_status
from tests.support.kubeapi import running_fake_api
from tests.support.lora_adapters import make_adapter
from tests.support.tiny_models import make_tiny_model
from tests.support.waiting import wait_for
from tests.unit.operator.factories import make_cr, make_raw_spec, make_ref

pytestmark = pytest.mark.slow
API_KEY = "lora-key"


def _raw(adapters: list[dict[str, Any]]) -> dict[str, Any]:
    """The service's spec: the tiny model, ``adapters``, run-time updates, the API key's Secret."""
    return make_raw_spec(
        model={
            "name": "tiny",
            "source": {"pvc": {"claimName": "models", "path": "tiny"}},
            "adapters": adapters,
        },
        runtime={"lora": {"maxLoras": 2, "maxLoraRank": 16, "runtimeUpdates": True}},
        versions={"policy": "Off"},
        apiKeySecretRef={"name": "tiny-key", "key": "token"},
    )


def _spec(adapters: list[dict[str, Any]]) -> InferenceSpec:
    return parse_spec(_raw(adapters))


def _pvc_adapter(name: str) -> dict[str, Any]:
    return {"name": name, "source": {"pvc": {"claimName": "adapters", "path": name}}}


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The node's view: the model and every adapter under the paths the pod mounts them at."""
    root = tmp_path_factory.mktemp("node")
    model = make_tiny_model(root / "models" / "tiny")
    volume = adapter_mounts(_spec([_pvc_adapter("sql")]), image_volumes=False)[0].volume
    for seed, name in enumerate(("sql", "tone", "tone-v2"), start=1):
        make_adapter(model, root / "adapters" / volume / name, rank=4, seed=seed)
    return root


def _on_host(host: Path, text: str) -> str:
    """A container path (or ``name=path``) as the node holds it."""
    name, separator, path = text.rpartition("=")
    for mount in (names.MODEL_MOUNT_PATH, "/adapters"):
        if path.startswith(f"{mount}/"):
            return f"{name}{separator}{host / mount.strip('/')}{path[len(mount) :]}"
    return text


@pytest.fixture(scope="module")
def pod(host: Path) -> Iterator[tuple[str, AdapterPod, Path]]:
    """A runtime started by the pod's own command with the ConfigMap of a service serving ``sql``."""
    spec = _spec([_pvc_adapter("sql")])
    pod_spec = build_pod_spec(make_ref(), spec, "kunlun-runtime:test", image_volumes=False)
    container = pod_spec["containers"][0]
    modules = host / "lora-modules"
    data = build_config_data(spec, model_path(spec, image_volumes=False))
    modules.write_text("".join(f"{_on_host(host, line)}\n" for line in data["lora-modules"].splitlines()))
    # The kubelet's part: $$ is Kubernetes' escape for $; the ConfigMap file and volumes are mounted.
    command = [
        part.replace("$$", "$").replace(LORA_MODULES_FILE, str(modules)) for part in container["command"]
    ]
    port = free_port()
    args = [_on_host(host, arg) for arg in container["args"]]
    args[args.index("--port") + 1] = str(port)
    args += ["--host", "127.0.0.1", "--dtype", "float32", "--kv-cache-memory", "16MiB", "--api-key", API_KEY]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    log = host / "runtime.log"
    with log.open("wb") as out:
        process = subprocess.Popen([*command, *args], stdout=out, stderr=subprocess.STDOUT, env=env)
    base_url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert process.poll() is None, f"the runtime exited:\n{log.read_text()}"
        return health_status(base_url) == 200

    try:
        wait_for(ready, timeout_seconds=300.0, message="the runtime")
        volumes = frozenset(v["name"] for v in pod_spec["volumes"])
        yield base_url, AdapterPod("qwen-0", "uid-0", "127.0.0.1", port, volumes), host
    finally:
        process.terminate()
        process.wait(timeout=60)


class NodeView(AdapterSyncer):
    """The operator's syncer, each adapter's container path given as the node holds it (the test
    plays the kubelet's mounts: the runtime runs on this machine)."""

    def __init__(self, host: Path) -> None:
        self.host = host

    def sync(
        self, where: str, desired: Sequence[AdapterMount], pods: Iterable[AdapterPod], api_key: str | None
    ) -> AdapterOutcome:
        on_host = [dataclasses.replace(m, path=_on_host(self.host, m.path)) for m in desired]
        return super().sync(where, on_host, pods, api_key)


def _served(base_url: str) -> dict[str, str]:
    request = urllib.request.Request(f"{base_url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        models = json.load(answer)["data"]
    return {m["id"]: m["root"] for m in models if m.get("parent") == "tiny"}


def _sync(
    pod: tuple[str, AdapterPod, Path], spec: InferenceSpec, api_key: str = API_KEY
) -> tuple[AdapterState, ...]:
    """One pass of the operator's syncer on the pod, with the adapters' paths as the node holds them."""
    _, runtime, host = pod
    desired = adapter_mounts(spec, image_volumes=False)
    outcome = NodeView(host).sync("ml/qwen", desired, [runtime], api_key)
    assert [p.pod for p in outcome.pods] == ["qwen-0"]
    return outcome.pods[0].states


def test_a_new_pod_serves_the_configmaps_adapters_and_the_operator_updates_them_in_place(
    host: Path, pod: tuple[str, AdapterPod, Path]
) -> None:
    base_url = pod[0]
    volume = f"/adapters/{adapter_mounts(_spec([_pvc_adapter('sql')]), image_volumes=False)[0].volume}"
    # Started by the wrapper: the ConfigMap's adapter is served from the first request on.
    assert _served(base_url) == {"sql": _on_host(host, f"{volume}/sql")}

    # Nothing to do for what is served already; a new adapter is loaded.
    two = _spec([_pvc_adapter("sql"), _pvc_adapter("tone")])
    assert _sync(pod, two) == (AdapterState("sql", "Loaded"), AdapterState("tone", "Loaded"))
    assert set(_served(base_url)) == {"sql", "tone"}

    # A removed adapter is unloaded; one whose source moved is replaced in place under its name.
    moved = {"name": "tone", "source": {"pvc": {"claimName": "adapters", "path": "tone-v2"}}}
    assert _sync(pod, _spec([moved])) == (AdapterState("tone", "Loaded"),)
    assert _served(base_url) == {"tone": _on_host(host, f"{volume}/tone-v2")}


def test_what_the_runtime_refuses_is_reported_per_adapter_with_its_message(
    pod: tuple[str, AdapterPod, Path],
) -> None:
    base_url = pod[0]
    missing = _spec([_pvc_adapter("sql"), _pvc_adapter("nowhere")])
    states = _sync(pod, missing)
    assert states[0] == AdapterState("sql", "Loaded")
    assert (states[1].name, states[1].state) == ("nowhere", "Failed")
    assert states[1].message.startswith("400 ") and "nowhere" in states[1].message
    assert "nowhere" not in _served(base_url)

    # A wrong API key: the runtime's 401, for every adapter (nothing is assumed loaded).
    refused = _sync(pod, _spec([_pvc_adapter("sql")]), api_key="wrong")
    assert [(s.name, s.state) for s in refused] == [("sql", "Failed")]
    assert refused[0].message.startswith("GET /v1/models: 401 ")


def test_an_adapter_whose_volume_the_pod_lacks_waits_for_the_rollout(
    pod: tuple[str, AdapterPod, Path],
) -> None:
    base_url = pod[0]
    other = {"name": "other", "source": {"pvc": {"claimName": "more-adapters", "path": "other"}}}
    states = _sync(pod, _spec([_pvc_adapter("sql"), other]))
    assert [(s.name, s.state) for s in states] == [("sql", "Loaded"), ("other", "Pending")]
    assert "is not mounted in this pod yet" in states[1].message
    assert "other" not in _served(base_url)


def _service(adapters: list[dict[str, Any]]) -> dict[str, Any]:
    return {**make_cr(_raw(adapters)), "metadata": {"name": "qwen", "namespace": "ml"}}


def _runtime_pod(runtime: AdapterPod, volumes: Iterable[str]) -> dict[str, Any]:
    """The pod as the API holds it: the template's labels, its ``http`` port (where the test's
    runtime listens) and volumes."""
    return {
        "metadata": {"name": runtime.name, "labels": names.selector_labels("qwen")},
        "spec": {
            "containers": [
                {
                    "name": "runtime",
                    "image": "kunlun-runtime:test",
                    "ports": [{"name": "http", "containerPort": runtime.port, "protocol": "TCP"}],
                }
            ],
            "volumes": [{"name": v} for v in sorted(volumes)],
        },
    }


def test_the_controller_applies_a_changed_adapter_list_to_the_pod_and_reports_it_on_the_service(
    tmp_path: Path, pod: tuple[str, AdapterPod, Path]
) -> None:
    """Controller.sync_adapters on the fake API: the API key read from its Secret, the pod found by
    its labels and called on its own port, status.adapters and AdaptersReady written on the CR."""
    base_url, runtime, host = pod
    with running_fake_api(tmp_path) as kube:
        api = kube.client()
        core, custom = kubernetes.client.CoreV1Api(api), kubernetes.client.CustomObjectsApi(api)
        secret = {
            "metadata": {"name": "tiny-key"},
            "data": {"token": base64.b64encode(API_KEY.encode()).decode()},
        }
        core.create_namespaced_secret("ml", secret)
        core.create_namespaced_pod("ml", _runtime_pod(runtime, runtime.volumes))
        ready = {"type": "ContainersReady", "status": "True"}
        core.patch_namespaced_pod_status(
            "qwen-0", "ml", {"status": {"podIP": "127.0.0.1", "conditions": [ready]}}
        )
        kis = ("serving.kunlun.dev", "v1alpha1", "ml", "kunluninferenceservices")
        custom.create_namespaced_custom_object(*kis, _service([_pvc_adapter("sql"), _pvc_adapter("tone")]))
        controller = Controller(
            KubeClient(api), ControllerConfig(), OperatorMetrics(), lambda *_: None, adapters=NodeView(host)
        )

        def status() -> tuple[list[dict[str, Any]], tuple[str, str, str]]:
            got = custom.get_namespaced_custom_object(*kis, "qwen")["status"]
            ready = next(c for c in got["conditions"] if c["type"] == "AdaptersReady")
            return got["adapters"], (ready["status"], ready["reason"], ready["message"])

        controller.reconcile_key("ml", "qwen", ())
        loaded = [{"name": "sql", "state": "Loaded"}, {"name": "tone", "state": "Loaded"}]
        assert status() == (
            [{"pod": "qwen-0", "adapters": loaded}],
            ("True", "AdaptersLoaded", "2 adapter(s) loaded on 1 ready pod(s)"),
        )
        assert set(_served(base_url)) == {"sql", "tone"}

        # sql dropped, tone moved: unloaded, and replaced in place; no rollout needed.
        template = kube.objects("deployments", "apps")[0]["spec"]["template"]
        moved = {"name": "tone", "source": {"pvc": {"claimName": "adapters", "path": "tone-v2"}}}
        custom.patch_namespaced_custom_object(*kis, "qwen", {"spec": {"model": {"adapters": [moved]}}})
        controller.reconcile_key("ml", "qwen", ())
        assert status()[0] == [{"pod": "qwen-0", "adapters": [{"name": "tone", "state": "Loaded"}]}]
        volume = adapter_mounts(_spec([moved]), image_volumes=False)[0].volume
        assert _served(base_url) == {"tone": _on_host(host, f"/adapters/{volume}/tone-v2")}
        assert kube.objects("deployments", "apps")[0]["spec"]["template"] == template

        # The Secret refused (no operator.rbac.apiKeySecrets): every adapter Failed with the 403.
        kube.fail("get", "secrets", status=403, times=None)
        controller.reconcile_key("ml", "qwen", ())
        adapters, condition = status()
        assert adapters[0]["adapters"][0]["state"] == "Failed"
        assert condition[:2] == ("False", "AdapterLoadFailed") and "403" in condition[2]

"""LoRA adapters on a real ``kunlun-runtime serve``, started as the operator's pod would start it.

The runtime container's command and arguments come from the operator's pod builder for a service
with ``runtimeUpdates``; the test plays the kubelet (``$$`` → ``$``, the ConfigMap's
``lora-modules`` file, the volumes at their mount paths) so the shell wrapper itself starts the
runtime with the ConfigMap's adapters. Then the operator's ``AdapterSyncer`` loads, replaces and
unloads adapters on it through the real API, and reports what the runtime refuses.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kunlun_operator import names
from kunlun_operator.builders.adapters import LORA_MODULES_FILE, adapter_mounts
from kunlun_operator.builders.configmap import build_config_data
from kunlun_operator.builders.pod_template import build_pod_spec, model_path
from kunlun_operator.decide.adapters import AdapterPod, AdapterState
from kunlun_operator.shell.pod_adapters import AdapterSyncer
from kunlun_operator.spec.service import parse_spec
from kunlun_operator.spec.values import InferenceSpec
from tests.integration.server.live import free_port, health_status
from tests.support.lora_adapters import make_adapter
from tests.support.tiny_models import make_tiny_model
from tests.support.waiting import wait_for
from tests.unit.operator.factories import make_raw_spec, make_ref

pytestmark = pytest.mark.slow
API_KEY = "lora-key"


def _spec(adapters: list[dict[str, Any]]) -> InferenceSpec:
    raw = make_raw_spec(
        model={
            "name": "tiny",
            "source": {"pvc": {"claimName": "models", "path": "tiny"}},
            "adapters": adapters,
        },
        runtime={"lora": {"maxLoras": 2, "maxLoraRank": 16, "runtimeUpdates": True}},
        versions={"policy": "Off"},
    )
    return parse_spec(raw)


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
        yield base_url, AdapterPod("qwen-0", "uid-0", "127.0.0.1", volumes), host
    finally:
        process.terminate()
        process.wait(timeout=60)


def _served(base_url: str) -> dict[str, str]:
    request = urllib.request.Request(f"{base_url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        models = json.load(answer)["data"]
    return {m["id"]: m["root"] for m in models if m.get("parent") == "tiny"}


def _sync(
    pod: tuple[str, AdapterPod, Path], spec: InferenceSpec, api_key: str = API_KEY
) -> tuple[AdapterState, ...]:
    """One pass of the operator's syncer on the pod, with the adapters' paths as the node holds them."""
    base_url, runtime, host = pod
    desired = [
        dataclasses.replace(m, path=_on_host(host, m.path)) for m in adapter_mounts(spec, image_volumes=False)
    ]
    outcome = AdapterSyncer(url_of=lambda _: base_url).sync("ml/qwen", desired, [runtime], api_key)
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

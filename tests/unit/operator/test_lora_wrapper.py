"""Adapter paths reach the runtime unchanged: through the pod's arguments and through the
``sh -c`` wrapper that reads the ConfigMap's ``lora-modules`` under ``runtimeUpdates``.

The test plays the kubelet with Kubernetes' own expansion of command and arguments (``$(VAR)``
from the environment, ``$$`` for ``$``), then runs the real wrapper with ``sh`` and a stand-in
``kunlun-runtime`` that prints the arguments it was given.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kunlun_operator.builders.adapters import LORA_MODULES_FILE, LORA_MODULES_KEY
from kunlun_operator.builders.configmap import build_config_data
from kunlun_operator.builders.pod_template import build_pod_spec, model_path
from kunlun_operator.spec.service import parse_spec
from tests.unit.operator.factories import make_raw_spec, make_ref

#: Directory names a shell or Kubernetes could misread: blanks, quotes, globs, $ and $(VAR).
ODD_PATHS = ("my adapters/v 1", "a$b/$(HOME)/${PATH}", "q'uo\"te/`id`", "glob/*/[a]?", "semi;colon|&")
ENV = {"HOME": "/tmp", "PATH": "/usr/bin"}


def kubelet_expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of a container's command and arguments: ``$(VAR)`` becomes the
    variable's value (kept as written when undefined), ``$$`` becomes ``$``, any other ``$`` stays."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text[i] != "$" or i + 1 == len(text):
            out.append(text[i])
            i += 1
        elif text[i + 1] == "$":
            out.append("$")
            i += 2
        elif text[i + 1] == "(" and (end := text.find(")", i + 2)) != -1:
            name = text[i + 2 : end]
            out.append(env.get(name, f"$({name})"))
            i = end + 1
        else:
            out.append(text[i : i + 2])
            i += 2
    return "".join(out)


def test_kubelet_expand_follows_kubernetes() -> None:
    assert kubelet_expand("$(HOME)/$$(HOME)/$(NONE)/$x/$$$/$(", ENV) == "/tmp/$(HOME)/$(NONE)/$x/$$/$("


def _spec(runtime_updates: bool) -> Any:
    adapters = [
        {"name": f"a{i}", "source": {"pvc": {"claimName": "adapters", "path": path}}}
        for i, path in enumerate(ODD_PATHS)
    ]
    model = {
        "name": "qwen",
        "source": {"pvc": {"claimName": "models", "path": "m$(HOME)"}},
        "adapters": adapters,
    }
    return parse_spec(make_raw_spec(model=model, runtime={"lora": {"runtimeUpdates": runtime_updates}}))


def _expected_modules(container: dict[str, Any]) -> list[str]:
    volume = next(
        m["mountPath"] for m in container["volumeMounts"] if m["mountPath"].startswith("/adapters/")
    )
    return [f"a{i}={volume}/{path}" for i, path in enumerate(ODD_PATHS)]


def test_without_runtime_updates_the_arguments_carry_odd_paths_literally() -> None:
    container = build_pod_spec(make_ref(), _spec(False), "img", image_volumes=False)["containers"][0]
    args = [kubelet_expand(a, ENV) for a in container["args"]]
    start = args.index("--lora-modules") + 1
    assert args[start : start + len(ODD_PATHS)] == _expected_modules(container)
    assert args[args.index("--model") + 1] == "/models/m$(HOME)"


@pytest.mark.skipif(sys.platform == "win32", reason="a POSIX sh")
def test_the_wrapper_passes_the_configmaps_odd_paths_as_one_argument_each(tmp_path: Path) -> None:
    spec = _spec(True)
    container = build_pod_spec(make_ref(), spec, "img", image_volumes=False)["containers"][0]
    modules = tmp_path / "lora-modules"  # the ConfigMap's key, as the kubelet mounts it
    modules.write_text(build_config_data(spec, model_path(spec, image_volumes=False))[LORA_MODULES_KEY])
    stub = tmp_path / "bin" / "kunlun-runtime"
    stub.parent.mkdir()
    stub.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    stub.chmod(0o755)
    command = [kubelet_expand(c, ENV).replace(LORA_MODULES_FILE, str(modules)) for c in container["command"]]
    args = [kubelet_expand(a, ENV) for a in container["args"]]
    env = {**os.environ, "PATH": f"{stub.parent}{os.pathsep}{os.environ['PATH']}"}
    run = subprocess.run([*command, *args], capture_output=True, text=True, env=env, cwd=tmp_path, check=True)
    received = json.loads(run.stdout)
    assert received[: len(args)] == args
    assert received[len(args) :] == ["--lora-modules", *_expected_modules(container)]

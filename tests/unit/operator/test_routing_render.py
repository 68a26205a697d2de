"""``kunlun-operator render`` of a routed service: the APIs it needs are named by ``-a``, the
operator's routing flags shape it, and without them it is refused naming the missing API."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from kunlun_operator import names
from kunlun_operator.decide.routing import require_routing_apis
from kunlun_operator.shell.cli import build_parser, controller_config
from kunlun_operator.spec.service import parse_spec
from tests.unit.operator.factories import EXAMPLES, load_example
from tests.unit.operator.test_render import run, write_config

ROUTED = str(EXAMPLES / "kis-routed.yaml")
ROUTING_API = ["-a", names.INFERENCE_GROUP_VERSION, "-a", names.GATEWAY_GROUP_VERSION]


def test_the_routed_example_renders_its_pool_picker_and_route(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "-f", ROUTED, "--config", write_config(tmp_path, []), *ROUTING_API)
    assert (code, err) == (0, "")
    objects = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(out)}
    assert ("InferencePool", "qwen-chat") in objects and ("HTTPRoute", "qwen-chat") in objects
    picker = objects["Deployment", "qwen-chat-epp"]["spec"]["template"]["spec"]["containers"][0]
    assert picker["image"] == names.DEFAULT_PRECISE_ENDPOINT_PICKER_IMAGE


def test_without_the_apis_the_routed_example_is_refused_naming_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path, [])
    code, out, err = run(capsys, "-f", ROUTED, "--config", config)
    assert (code, out) == (1, "")
    assert (
        "is refused (InferencePoolNotInstalled): spec.routing.type: InferencePool routing needs the " in err
    )
    assert "(inference.networking.k8s.io/v1)" in err
    code, out, err = run(capsys, "-f", ROUTED, "--config", config, "-a", names.INFERENCE_GROUP_VERSION)
    assert (code, out) == (1, "")
    assert (
        "(HTTPRouteNotInstalled): spec.routing.gateway: " in err and "(gateway.networking.k8s.io/v1)" in err
    )
    # an operator run with --no-inference-pool (the chart without routing.enabled) refuses it too
    off = write_config(tmp_path, ["--no-inference-pool"])
    code, out, err = run(capsys, "-f", ROUTED, "--config", off, *ROUTING_API)
    assert (code, out) == (1, "") and "(InferencePoolNotInstalled)" in err


def test_the_picker_images_are_the_operators_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = [
        "--endpoint-picker-image=mirror.local/epp:v1.5.0",
        "--precise-endpoint-picker-image=mirror.local/llm-d:v0.8.0",
        "--precise-tokenizer-image=mirror.local/uds-tokenizer:v0.7.1",
    ]
    config = controller_config(build_parser().parse_args(["run", *flags]))
    images = config.picker_images
    assert (images.endpoint_picker, images.precise_endpoint_picker, images.precise_tokenizer) == (
        "mirror.local/epp:v1.5.0",
        "mirror.local/llm-d:v0.8.0",
        "mirror.local/uds-tokenizer:v0.7.1",
    )
    assert config.inference_pool is True
    code, out, _ = run(capsys, "-f", ROUTED, "--config", write_config(tmp_path, flags), *ROUTING_API)
    assert code == 0 and "image: mirror.local/llm-d:v0.8.0\n" in out
    assert "image: mirror.local/uds-tokenizer:v0.7.1\n" in out


def test_the_documented_routing_rejection_is_the_operators_message() -> None:
    """docs/operator.md quotes the denial a routed service gets without the InferencePool API."""
    spec = parse_spec(load_example("kis-routed.yaml")["spec"])
    error = require_routing_apis(spec, inference_pool_served=False, httproute_served=False)
    doc = (EXAMPLES.parent / "docs" / "operator.md").read_text()
    assert re.findall(r"```text\n(spec\.routing\.type: .+)\n```", doc) == [str(error)]

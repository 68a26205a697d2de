"""The operator's readiness gate on card health follows the device plugin's fault response: the gate
is only safe where the node agent sets the ``kunlun.dev/xpu-healthy`` condition."""

from __future__ import annotations

import pytest

from kunlun_operator.shell import cli as operator_cli
from tests.chart.tools import render


@pytest.mark.parametrize(
    ("plugin_enabled", "faults_enabled", "gate"),
    [
        (None, None, True),
        (True, True, True),
        (True, False, False),
        (False, None, False),  # bring-your-own device plugin: nothing sets the condition
        (False, True, False),
    ],
)
def test_the_health_gate_is_on_exactly_when_the_device_plugin_sets_the_condition(
    plugin_enabled: bool | None, faults_enabled: bool | None, gate: bool
) -> None:
    device_plugin: dict[str, object] = {}
    if plugin_enabled is not None:
        device_plugin["enabled"] = plugin_enabled
    if faults_enabled is not None:
        device_plugin["faults"] = {"enabled": faults_enabled}
    rendered = render(overrides={"devicePlugin": device_plugin} if device_plugin else {})
    [deployment] = [d for d in rendered.all("Deployment") if d["metadata"]["name"].endswith("-operator")]
    args = operator_cli.build_parser().parse_args(
        deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    assert args.xpu_health_gate is gate

"""The operator's readiness gate on card health follows the device plugin's fault response: the gate
is only safe where the node agent sets the ``kunlun.dev/xpu-healthy`` condition."""

from __future__ import annotations

import pytest

from kunlun_operator import cli as operator_cli
from tests.chart.tools import render


@pytest.mark.parametrize(("faults_enabled", "gate"), [(None, True), (True, True), (False, False)])
def test_the_health_gate_is_on_exactly_when_the_device_plugin_sets_the_condition(
    faults_enabled: bool | None, gate: bool
) -> None:
    overrides = {} if faults_enabled is None else {"devicePlugin": {"faults": {"enabled": faults_enabled}}}
    rendered = render(overrides=overrides)
    [deployment] = [d for d in rendered.all("Deployment") if d["metadata"]["name"].endswith("-operator")]
    args = operator_cli.build_parser().parse_args(
        deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    assert args.xpu_health_gate is gate

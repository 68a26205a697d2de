"""Where the controller takes the compatibility matrix from (the API client is faked at its seam)."""

from __future__ import annotations

from typing import Any

import pytest

from kunlun_operator import names
from kunlun_operator.shell.controller import Controller, ControllerConfig
from kunlun_operator.shell.metrics import OperatorMetrics


class ConfigMapOnlyClient:
    """Answers ``get`` for one ConfigMap (None for anything else), like ``KubeClient.get``."""

    def __init__(self, data: dict[str, str] | None) -> None:
        self.data = data

    def get(self, kind: names.Kind, namespace: str | None, name: str) -> dict[str, Any] | None:
        if (kind, namespace, name) == (names.CONFIGMAP, "kunlun-system", "matrix") and self.data is not None:
            return {"data": self.data}
        return None


def _controller(data: dict[str, str] | None) -> Controller:
    config = ControllerConfig(matrix_configmap=("kunlun-system", "matrix"))
    return Controller(ConfigMapOnlyClient(data), config, OperatorMetrics(), lambda *_: None)  # type: ignore[arg-type]


def test_the_configmap_matrix_is_used_with_the_default_card_table() -> None:
    text = "entries:\n- {runtime: 0.2.0, driver: [6.0.0], firmware: [2.0.0], kml: [4.0.0]}\n"
    matrix = _controller({"matrix.yaml": text}).load_matrix()
    assert [e.runtime for e in matrix.entries] == ["0.2.0"]
    assert matrix.card_memory_bytes["P800"] == 96 * 2**30


@pytest.mark.parametrize(
    "data",
    [None, {"other": "x"}, {"matrix.yaml": "entries: [{runtime: x}]"}],
    ids=["no configmap", "no matrix key", "malformed"],
)
def test_the_packaged_matrix_is_used_when_the_configmap_is_absent_or_malformed(data: Any) -> None:
    controller = _controller(data)
    assert controller.load_matrix() is controller.default_matrix

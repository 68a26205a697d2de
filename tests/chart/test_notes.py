"""NOTES.txt names the runtime image the operator will run and warns when nobody can have pushed it.

The image in the notes is checked against the operator's own choice (``matrix.select_image``) over
what the same install renders: the compatibility ConfigMap the operator reads and the
``--default-runtime-image`` it is started with (or its packaged matrix, moved under that image's
registry, when the chart installs no ConfigMap).
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import yaml

from kunlun_operator.policy import matrix
from kunlun_operator.shell import cli
from kunlun_operator.shell.controller import Controller, ControllerConfig
from kunlun_operator.shell.metrics import OperatorMetrics
from kunlun_operator.spec.service import parse_spec
from tests.chart.tools import CHART, NAMESPACE, RELEASE, helm

WARNING = re.compile(r"WARNING: (\S+)\n\s+is the default matrix image")


def install(overrides: dict | None = None) -> tuple[str, list[dict]]:
    """``helm install --dry-run=client``: the NOTES and the rendered objects."""
    with tempfile.TemporaryDirectory() as tmp:
        values = Path(tmp) / "values.yaml"
        values.write_text(yaml.safe_dump(overrides or {}))
        proc = helm(
            "install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client", "-f", str(values)
        )
    manifest, notes = proc.stdout.split("NOTES:", 1)
    return notes, [d for d in yaml.safe_load_all(manifest.split("MANIFEST:", 1)[1]) if d]


def operators_image(docs: list[dict], notes: str) -> str:
    """The image the rendered operator gives the notes' first model (no spec.runtime.image)."""
    [operator] = [
        d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-operator")
    ]
    args = cli.build_parser().parse_args(operator["spec"]["template"]["spec"]["containers"][0]["args"])
    configmaps = [
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-compatibility")
    ]
    config = ControllerConfig(default_image=args.default_runtime_image)
    # no API calls: only the matrix the operator falls back to (its packaged one, moved under the
    # registry of --default-runtime-image)
    controller = Controller(None, config, OperatorMetrics(), lambda *_: None)  # type: ignore[arg-type]
    if configmaps:
        text = configmaps[0]["data"][matrix.MATRIX_KEY]
        chosen = matrix.merge_cards(matrix.parse_matrix(text, source="chart"), controller.default_matrix)
    else:
        chosen = controller.default_matrix
    block = notes.split("kubectl apply -f -\n", 1)[1].split("     YAML\n", 1)[0]
    spec = parse_spec(yaml.safe_load("\n".join(line[5:] for line in block.splitlines()))["spec"])
    return matrix.select_image(chosen, spec.versions, args.default_runtime_image)


def test_the_default_install_names_the_operators_image_and_warns_it_is_unbuilt() -> None:
    notes, docs = install()
    image = operators_image(docs, notes)
    assert image == "ghcr.io/kunlun-inference/kunlun-runtime:0.1.0-kunlun"
    assert f"kml 3.2.0  ->  {image}\n" in notes
    assert WARNING.findall(notes) == [image]
    assert "make images KUNLUN_STACK=/path/to/kunlun-stack" in notes
    assert "RuntimeImageAvailable=False" in notes and "docs/chart.md#container-images" in notes
    assert (
        "Other versions (policy Warn/Off) run ghcr.io/kunlun-inference/kunlun-runtime:0.1.0 (runtime.image)"
        in notes
    )


def test_an_own_registry_names_the_image_there_without_the_warning() -> None:
    notes, docs = install({"global": {"imageRegistry": "registry.example.com/ml"}})
    image = operators_image(docs, notes)
    assert image == "registry.example.com/ml/kunlun-runtime:0.1.0-kunlun"
    assert f"->  {image}\n" in notes
    assert WARNING.findall(notes) == []
    assert "Each must exist under the name shown" in notes


def test_without_the_configmap_the_notes_still_name_the_packaged_matrixs_image() -> None:
    notes, docs = install({"compatibility": {"enabled": False}})
    image = operators_image(docs, notes)
    assert f"->  {image}\n" in notes and WARNING.findall(notes) == [image]


def test_notes_render_with_an_extra_entry_naming_its_own_registry() -> None:
    extra = {
        "runtime": "0.1.0",
        "driver": ["5.0.22"],
        "firmware": ["1.0.3"],
        "kml": ["3.3.0"],
        "image": "localhost:5000/rt:1",
    }
    notes, _ = install({"compatibility": {"extraEntries": [extra]}})
    assert "driver 5.0.22, firmware 1.0.3, kml 3.3.0  ->  localhost:5000/rt:1\n" in notes


def test_the_notes_warn_that_allocation_both_can_hand_a_card_out_twice() -> None:
    mixed, _ = install({"devicePlugin": {"nodePools": {"mixed": "both", "dra": "dra"}}})
    warning = " ".join(mixed.split("WARNING: allocation both on", 1)[1].split())
    assert warning.startswith("node pool(s) mixed: the classic device plugin and the DRA plugin")
    assert "one card can go to two pods" in warning
    everywhere, _ = install({"devicePlugin": {"allocation": "both"}})
    assert "WARNING: allocation both on nodes in no pool:" in everywhere
    for single in ({"devicePlugin": {"nodePools": {"dra": "dra"}}}, None):
        notes, _ = install(single)
        assert "allocation both" not in notes

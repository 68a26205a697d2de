"""The Grafana dashboard: well-formed, templated by data source, namespace and model, and laying
serving SLOs and chip health side by side."""

from __future__ import annotations

import json

from tests.chart.tools import CHART, Rendered

DASHBOARD = CHART / "files" / "dashboards" / "kunlun-inference.json"


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_configmap_carries_the_dashboard_file_verbatim(monitoring_render: Rendered) -> None:
    configmap = monitoring_render.one("ConfigMap", "-dashboard")
    assert json.loads(configmap["data"]["kunlun-inference.json"]) == load()
    assert configmap["metadata"]["annotations"] == {"grafana_folder": "Kunlun Inference"}


def test_panels_have_unique_ids_and_do_not_overlap() -> None:
    panels = load()["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = set()
    for panel in panels:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        mine = {
            (x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not cells & mine, f"{panel['title']} overlaps another panel"
        cells |= mine


def test_every_query_uses_the_datasource_variable_and_model_filter_where_it_serves() -> None:
    dashboard = load()
    variables = [v["name"] for v in dashboard["templating"]["list"]]
    assert variables == ["datasource", "namespace", "model"]
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            if "vllm:" in target["expr"]:
                assert 'model_name=~"$model"' in target["expr"], panel["title"]


def test_rows_put_serving_slos_beside_the_chips_of_each_model() -> None:
    rows = [p["title"] for p in load()["panels"] if p["type"] == "row"]
    assert rows[0] == "Serving SLOs"
    chips = next(p for p in load()["panels"] if p["type"] == "row" and p["title"].startswith("Chips serving"))
    chip_panels = [
        p for p in load()["panels"] if p["type"] != "row" and p["gridPos"]["y"] == chips["gridPos"]["y"] + 1
    ]
    assert {p["title"] for p in chip_panels} == {
        "XPU utilisation",
        "XPU memory used",
        "XPU temperature",
        "XPU power",
    }
    for panel in chip_panels:
        expr = panel["targets"][0]["expr"]
        assert "group_left (model_name)" in expr and "on (namespace, pod)" in expr, panel["title"]

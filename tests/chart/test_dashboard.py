"""The Grafana dashboard: well-formed, templated by data source, namespace and model, and laying
serving SLOs and chip health side by side."""

from __future__ import annotations

import json
import re

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


def _rate(metric: str, by: str = "model_name") -> str:
    """A per-model rate as the dashboard's other panels write it."""
    return (
        f'sum by ({by}) (rate({metric}{{model_name=~"$model", namespace=~"$namespace"}}[$__rate_interval]))'
    )


def test_the_speculative_decoding_row_shows_acceptance_rate_tokens_per_draft_and_positions() -> None:
    panels = load()["panels"]
    row = next(p for p in panels if p["type"] == "row" and p["title"] == "Speculative decoding")
    shown = {
        p["title"]: ([t["expr"] for t in p["targets"]], p["fieldConfig"]["defaults"]["unit"])
        for p in panels
        if p["type"] != "row" and p["gridPos"]["y"] == row["gridPos"]["y"] + 1
    }
    accepted, drafts = "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_drafts_total"
    per_position = _rate("vllm:spec_decode_num_accepted_tokens_per_pos_total", "model_name, position")
    assert shown == {
        "Draft acceptance rate": (
            [f"{_rate(accepted)} / {_rate('vllm:spec_decode_num_draft_tokens_total')}"],
            "percentunit",
        ),
        "Accepted tokens per draft (mean)": ([f"{_rate(accepted)} / {_rate(drafts)}"], "short"),
        "Acceptance by draft position": (
            [f"{per_position} / on (model_name) group_left {_rate(drafts)}"],
            "percentunit",
        ),
    }


def test_the_speculative_panels_group_by_labels_the_runtime_exports() -> None:
    """The runtime's own counters carry every label the panels group and join on."""
    from prometheus_client import CollectorRegistry

    from kunlun_runtime.server.spec_metrics import SpecDecodeMetrics

    registry = CollectorRegistry()
    SpecDecodeMetrics(registry, "qwen").update((2, 6, 3, (2, 1)))
    exported = {
        f"{family.name}_total": set(sample.labels)
        for family in registry.collect()
        for sample in family.samples
    }
    grouped = [
        (panel["title"], metric, set(labels.split(", ")))
        for panel in load()["panels"]
        for target in panel.get("targets", [])
        if "spec_decode" in target["expr"]
        for labels, metric in re.findall(r"by \(([^)]*)\) \(rate\((vllm:[a-z_:]+)\{", target["expr"])
    ]
    assert len(grouped) == 6  # two rates in each of the three panels
    for title, metric, labels in grouped:
        assert labels <= exported[metric], (title, metric)

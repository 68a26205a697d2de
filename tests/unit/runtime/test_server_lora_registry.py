"""The served adapters (name → LoRARequest, ids, /v1/models cards, what a request's ``model`` picks)
and the ``vllm:lora_requests_info`` gauge as the Inference Extension reads it."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kunlun_runtime.errors import InvalidRequestError
from kunlun_runtime.lora.request import LoRARequest
from kunlun_runtime.server.adapters import ServedAdapters
from kunlun_runtime.server.errors import APIError
from kunlun_runtime.server.lora_metrics import LORA_REQUESTS_INFO, LoRARequestsInfo
from kunlun_runtime.server.responses import ModelCard


def make_adapters(*names: str) -> ServedAdapters:
    adapters = ServedAdapters("base", enabled=True)
    for name in names:
        adapters.add(adapters.new_request(name, f"/adapters/{name}"))
    return adapters


def test_ids_count_up_in_order_and_are_never_reused() -> None:
    adapters = make_adapters("sql", "tone")
    assert adapters.loras() == [
        LoRARequest("sql", 1, "/adapters/sql"),
        LoRARequest("tone", 2, "/adapters/tone"),
    ]
    assert adapters.remove("sql") == LoRARequest("sql", 1, "/adapters/sql")
    assert adapters.remove("sql") is None
    adapters.add(adapters.new_request("sql", "/adapters/sql-v2"))
    assert [(lora.lora_name, lora.lora_int_id) for lora in adapters.loras()] == [("tone", 2), ("sql", 3)]


def test_a_requests_model_picks_the_base_an_adapter_or_is_a_404() -> None:
    adapters = make_adapters("sql")
    assert adapters.resolve(None) is None
    assert adapters.resolve("base") is None
    assert adapters.resolve("sql") == LoRARequest("sql", 1, "/adapters/sql")
    with pytest.raises(APIError) as error:
        adapters.resolve("SQL")
    assert (error.value.status_code, error.value.message, error.value.param) == (
        404,
        "The model `SQL` does not exist.",
        "model",
    )


@pytest.mark.parametrize(
    ("name", "kwargs", "field", "message"),
    [
        ("sql", {}, "lora_name", "The lora adapter 'sql' has already been loaded."),
        ("base", {}, "lora_name", "'base' is the base model's name"),
        ("", {}, "lora_name", "must be a non-empty string"),
        ("a,b", {}, "lora_name", "contains ','"),
        (
            "new",
            {"base_model_name": "other"},
            "base_model_name",
            "is for 'other', but this server serves 'base'",
        ),
    ],
)
def test_a_name_that_cannot_be_served_is_a_400_and_takes_no_id(
    name: str, kwargs: dict[str, str], field: str, message: str
) -> None:
    adapters = make_adapters("sql")
    with pytest.raises(InvalidRequestError, match=message) as error:
        adapters.new_request(name, "/adapters/x", **kwargs)
    assert (error.value.field, error.value.status_code) == (field, 400)
    assert adapters.new_request("next", "/adapters/next").lora_int_id == 2


def test_replacing_a_served_name_is_allowed_only_when_asked() -> None:
    adapters = make_adapters("sql")
    lora = adapters.new_request("sql", "/adapters/sql-v2", replace=True)
    adapters.add(lora)
    assert adapters.loras() == [LoRARequest("sql", 2, "/adapters/sql-v2")]
    assert adapters.new_request("x", "/x", base_model_name="base").base_model_name == "base"


def test_without_enable_lora_nothing_can_be_added() -> None:
    with pytest.raises(InvalidRequestError, match="not enabled"):
        ServedAdapters("base").new_request("sql", "/adapters/sql")


def test_models_cards_name_the_base_as_parent_and_the_path_as_root() -> None:
    assert make_adapters("sql", "tone").cards(created=7) == [
        ModelCard(id="sql", created=7, root="/adapters/sql", parent="base"),
        ModelCard(id="tone", created=7, root="/adapters/tone", parent="base"),
    ]


def scrape(registry: CollectorRegistry) -> list[tuple[dict[str, str], float]]:
    families = text_string_to_metric_families(generate_latest(registry).decode())
    return [(s.labels, s.value) for f in families if f.name == LORA_REQUESTS_INFO for s in f.samples]


def test_the_gauge_is_one_series_of_the_latest_adapters_valued_by_its_update_time() -> None:
    registry = CollectorRegistry()
    info = LoRARequestsInfo(registry, max_loras=2)
    info.update(2, [], [], now=1000.0)
    assert scrape(registry) == [
        ({"max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}, 1000.0)
    ]
    info.update(2, ["sql", "tone", "sql"], ["tone", "sql", "x"], now=1001.5)
    assert scrape(registry) == [
        (
            {"max_lora": "2", "running_lora_adapters": "sql,tone", "waiting_lora_adapters": "tone,sql,x"},
            1001.5,
        )
    ]
    text = generate_latest(registry).decode()
    assert "# TYPE vllm:lora_requests_info gauge" in text


def test_the_gauge_is_stamped_with_the_wall_clock_when_no_time_is_given() -> None:
    import time

    registry = CollectorRegistry()
    info = LoRARequestsInfo(registry, max_loras=1)
    before = time.time()
    info.update(1, ["sql"], [])
    [(labels, value)] = scrape(registry)
    assert labels["running_lora_adapters"] == "sql"
    assert before <= value <= time.time()

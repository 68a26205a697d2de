"""``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``: vLLM's bodies and answers, every bad
input a 400 or 404 naming the problem with nothing served disturbed, the checkpoint read off the
event loop, and the routes absent unless run-time updating is allowed.

The engine is a stand-in here (``AdapterEngine``): what is under test is the routes' validation
and bookkeeping; the live server's tests (tests/integration/server/test_lora.py) load real
adapters into a real engine.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from kunlun_runtime.errors import InvalidRequestError
from kunlun_runtime.lora.request import LoRARequest
from kunlun_runtime.server.adapters import ServedAdapters
from kunlun_runtime.server.app import create_app
from kunlun_runtime.server.errors import install_error_handlers
from kunlun_runtime.server.lora_routes import install_lora_routes
from kunlun_runtime.server.served_model import ServedModel

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


@dataclass
class AdapterEngine:
    """Reads "adapters" (refusing paths under /bad as the engine refuses a bad checkpoint) and
    keeps a table of registered ones, recording the thread each call ran on."""

    table: dict[str, tuple[LoRARequest, object]] = field(default_factory=dict)
    read_threads: list[int] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)

    def read_lora(self, lora: LoRARequest) -> object:
        self.read_threads.append(threading.get_ident())
        if lora.lora_path.startswith("/bad"):
            raise InvalidRequestError(
                f"lora_path: {lora.lora_path}: no adapter_config.json", field="lora_path"
            )
        return ("weights", lora.lora_path)

    async def run_on_engine_thread(self, work: Callable[[Any], Any]) -> Any:
        return work(self)

    def add_lora(self, lora: LoRARequest, adapter: object | None = None) -> None:
        self.calls.append(f"add {lora.lora_name}")
        self.table[lora.lora_name] = (lora, adapter)

    def remove_lora(self, lora_name: str) -> bool:
        self.calls.append(f"remove {lora_name}")
        return self.table.pop(lora_name, None) is not None


def make_served() -> tuple[ServedModel, AdapterEngine]:
    engine = AdapterEngine()
    served = ServedModel(
        engine=engine,  # type: ignore[arg-type]
        name="base",
        max_model_len=64,
        vocab_size=100,
        root="base",
        adapters=ServedAdapters("base", enabled=True),
    )
    return served, engine


@pytest.fixture
def setup() -> tuple[httpx.AsyncClient, ServedModel, AdapterEngine]:
    served, engine = make_served()
    app = FastAPI()
    install_error_handlers(app)

    async def dependency() -> ServedModel:
        return served

    install_lora_routes(app, dependency)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    return client, served, engine


def error_of(response: httpx.Response) -> tuple[int, str, str | None]:
    error = response.json()["error"]
    return response.status_code, error["message"], error["param"]


async def test_load_then_unload_answer_as_vllm_and_change_what_is_served(setup) -> None:
    client, served, engine = setup
    response = await client.post(LOAD, json={"lora_name": "sql", "lora_path": "/adapters/sql"})
    assert (response.status_code, response.text) == (200, "Success: LoRA adapter 'sql' added successfully.")
    lora = LoRARequest("sql", 1, "/adapters/sql")
    assert served.adapters.loras() == [lora]
    assert engine.table == {"sql": (lora, ("weights", "/adapters/sql"))}  # registered what was read
    assert engine.read_threads and engine.read_threads[0] != threading.get_ident()  # off the event loop
    response = await client.post(UNLOAD, json={"lora_name": "sql"})
    assert (response.status_code, response.text) == (200, "Success: LoRA adapter 'sql' removed successfully.")
    assert served.adapters.loras() == [] and engine.table == {}


async def test_a_bad_adapter_is_a_400_naming_it_and_disturbs_nothing(setup) -> None:
    client, served, engine = setup
    await client.post(LOAD, json={"lora_name": "sql", "lora_path": "/adapters/sql"})
    before = (served.adapters.loras(), dict(engine.table), list(engine.calls))
    response = await client.post(LOAD, json={"lora_name": "tone", "lora_path": "/bad/tone"})
    assert error_of(response) == (400, "lora_path: /bad/tone: no adapter_config.json", "lora_path")
    response = await client.post(LOAD, json={"lora_name": "sql", "lora_path": "/adapters/other"})
    assert error_of(response) == (
        400,
        "The lora adapter 'sql' has already been loaded. If you want to load the adapter in place, "
        "set 'load_inplace' to True.",
        "lora_name",
    )
    response = await client.post(
        LOAD, json={"lora_name": "sql", "lora_path": "/bad/sql", "load_inplace": True}
    )
    assert response.status_code == 400
    assert (served.adapters.loras(), engine.table, engine.calls) == before


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"lora_name": "", "lora_path": "/a"}, "lora_name"),
        ({"lora_name": "x", "lora_path": ""}, "lora_path"),
        ({"lora_name": "x"}, "lora_path"),
        ({"lora_path": "/a"}, "lora_name"),
        ({"lora_name": "base", "lora_path": "/a"}, "lora_name"),
        ({"lora_name": "a,b", "lora_path": "/a"}, "lora_name"),
    ],
)
async def test_a_bad_load_body_is_a_400_naming_the_field(setup, body: dict[str, str], param: str) -> None:
    client, served, engine = setup
    response = await client.post(LOAD, json=body)
    status, message, named = error_of(response)
    assert (status, named) == (400, param)
    assert param in message
    assert served.adapters.loras() == [] and engine.calls == []


async def test_load_inplace_replaces_the_adapter_under_a_new_id(setup) -> None:
    client, served, engine = setup
    await client.post(LOAD, json={"lora_name": "sql", "lora_path": "/adapters/sql"})
    body = {"lora_name": "sql", "lora_path": "/adapters/sql-v2", "load_inplace": True}
    assert (await client.post(LOAD, json=body)).status_code == 200
    assert served.adapters.loras() == [LoRARequest("sql", 2, "/adapters/sql-v2")]
    assert engine.calls == ["add sql", "remove sql", "add sql"]
    assert engine.table["sql"][1] == ("weights", "/adapters/sql-v2")


async def test_unloading_an_unknown_adapter_is_vllms_404(setup) -> None:
    client, _served, engine = setup
    response = await client.post(UNLOAD, json={"lora_name": "nope"})
    assert error_of(response) == (404, "The lora adapter 'nope' cannot be found.", "lora_name")
    assert engine.calls == []


async def test_unloading_with_another_adapters_id_is_a_400(setup) -> None:
    client, served, _engine = setup
    await client.post(LOAD, json={"lora_name": "sql", "lora_path": "/adapters/sql"})
    response = await client.post(UNLOAD, json={"lora_name": "sql", "lora_int_id": 5})
    assert error_of(response) == (400, "lora_int_id: adapter 'sql' has id 1, not 5", "lora_int_id")
    assert [lora.lora_name for lora in served.adapters.loras()] == ["sql"]
    assert (await client.post(UNLOAD, json={"lora_name": "sql", "lora_int_id": 1})).status_code == 200


@pytest.mark.parametrize("allowed", [False, True])
async def test_the_routes_exist_only_when_runtime_updating_is_allowed(allowed: bool) -> None:
    def never() -> Any:
        raise AssertionError("the model is never loaded here")

    app = create_app(never, allow_runtime_lora_updating=allowed)  # its lifespan never runs: loading
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        for path in (LOAD, UNLOAD):
            response = await client.post(path, json={"lora_name": "x", "lora_path": "/a"})
            # Allowed: the route exists and answers that the model is still loading.
            assert response.status_code == (503 if allowed else 404), response.text

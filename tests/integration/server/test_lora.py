"""LoRA adapters on a live server: the ``openai`` client calls an adapter by name and gets what the
offline engine gives for it (greedy), /v1/models lists adapters under their base, adapters load
and unload at run time, every bad input is a 400 or 404 with its message and disturbs nothing
served, and ``vllm:lora_requests_info`` names the adapters in use while requests run.

Adapters are made by ``peft`` on the tiny model (random non-zero A and B); one server serves them
for the whole module, ``--lora-modules``-style ``sql`` from the start.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kunlun_runtime import LLM, LoRARequest, SamplingParams
from kunlun_runtime.options.lora import LoRAModule
from tests.integration.server.live import API_KEY, LiveServer, scrape, serve_in_thread
from tests.support.lora_adapters import make_adapter
from tests.support.tiny_models import TinySpec, make_tiny_model
from tests.support.waiting import wait_for

PROMPT = "The quick brown fox"
MAX_TOKENS = 8
LORA_INFO = "vllm:lora_requests_info"


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    wide = make_tiny_model(root / "wide-base", TinySpec(name="wide", hidden_size=96))
    return {
        "sql": make_adapter(tiny_model_dir, root / "sql", rank=8, seed=1),
        "tone": make_adapter(tiny_model_dir, root / "tone", rank=4, targets=("q_proj", "v_proj"), seed=2),
        "too-big": make_adapter(tiny_model_dir, root / "too-big", rank=32, seed=3),
        "other-base": make_adapter(wide, root / "other-base", rank=8, seed=4),
    }


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, adapter_dirs: dict[str, Path]) -> Iterator[LiveServer]:
    with serve_in_thread(
        tiny_model_dir,
        api_key=API_KEY,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
        lifecycle_options={"lora_modules": (LoRAModule("sql", str(adapter_dirs["sql"])),)},
        app_options={"allow_runtime_lora_updating": True},
    ) as live:
        yield live


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Path, adapter_dirs: dict[str, Path]) -> dict[str | None, str]:
    """The offline engine's greedy text for PROMPT on the base model and on each good adapter."""
    llm = LLM(
        str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=16 << 20, enable_lora=True, max_loras=2
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    texts: dict[str | None, str] = {None: llm.generate([PROMPT], params)[0].outputs[0].text}
    for number, name in enumerate(("sql", "tone"), start=1):
        lora = LoRARequest(name, number, str(adapter_dirs[name]))
        texts[name] = llm.generate([PROMPT], params, lora_request=lora)[0].outputs[0].text
    return texts


def client_of(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


def complete(client: openai.OpenAI, model: str, **kwargs: object) -> openai.types.Completion:
    return client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True},
        **kwargs,
    )


def post(server: LiveServer, path: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, headers=server.headers, timeout=120)


def error_of(response: httpx.Response) -> tuple[int, str]:
    return response.status_code, response.json()["error"]["message"]


def test_the_openai_client_calls_an_adapter_by_name_and_gets_the_offline_engines_text(
    server, offline
) -> None:
    assert offline["sql"] != offline[None]  # the adapter really changes the output
    client = client_of(server)
    answer = complete(client, "sql")
    assert (answer.model, answer.choices[0].text) == ("sql", offline["sql"])
    base = complete(client, server.model_name)
    assert (base.model, base.choices[0].text) == (server.model_name, offline[None])
    two = complete(client, "sql", n=2)
    assert [choice.text for choice in two.choices] == [offline["sql"]] * 2
    streamed = complete(client, "sql", stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == offline["sql"]


def test_chat_on_an_adapter_streams_what_it_answers_whole(server) -> None:
    client = client_of(server)
    messages = [{"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(
        model="sql", messages=messages, max_tokens=MAX_TOKENS, temperature=0.0
    )
    base = client.chat.completions.create(
        model=server.model_name, messages=messages, max_tokens=MAX_TOKENS, temperature=0.0
    )
    chunks = client.chat.completions.create(
        model="sql", messages=messages, max_tokens=MAX_TOKENS, temperature=0.0, stream=True
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert whole.model == "sql"
    assert streamed == whole.choices[0].message.content
    assert whole.choices[0].message.content != base.choices[0].message.content


def test_models_lists_each_adapter_under_its_base(server, adapter_dirs) -> None:
    models = {model.id: model.model_extra or {} for model in client_of(server).models.list().data}
    assert (models["sql"]["root"], models["sql"]["parent"]) == (str(adapter_dirs["sql"]), server.model_name)
    assert (models[server.model_name]["root"], models[server.model_name]["parent"]) == (
        server.model_name,
        None,
    )


def test_an_unknown_model_stays_a_404(server) -> None:
    with pytest.raises(openai.NotFoundError, match=r"The model `nope` does not exist\."):
        complete(client_of(server), "nope")


def test_an_adapter_loads_serves_and_unloads_at_run_time(server, offline, adapter_dirs) -> None:
    client = client_of(server)
    response = post(
        server, "/v1/load_lora_adapter", {"lora_name": "tone", "lora_path": str(adapter_dirs["tone"])}
    )
    assert (response.status_code, response.text) == (200, "Success: LoRA adapter 'tone' added successfully.")
    assert "tone" in {model.id for model in client.models.list().data}
    assert complete(client, "tone").choices[0].text == offline["tone"]
    response = post(server, "/v1/unload_lora_adapter", {"lora_name": "tone"})
    assert (response.status_code, response.text) == (
        200,
        "Success: LoRA adapter 'tone' removed successfully.",
    )
    assert "tone" not in {model.id for model in client.models.list().data}
    with pytest.raises(openai.NotFoundError, match=r"The model `tone` does not exist\."):
        complete(client, "tone")
    response = post(server, "/v1/unload_lora_adapter", {"lora_name": "tone"})
    assert error_of(response) == (404, "The lora adapter 'tone' cannot be found.")


def test_every_bad_load_is_a_400_naming_the_problem_and_disturbs_nothing(
    server, offline, adapter_dirs, tmp_path
):
    cases = [
        ({"lora_name": "x", "lora_path": str(tmp_path / "missing")}, "not found"),
        (
            {"lora_name": "x", "lora_path": str(adapter_dirs["too-big"])},
            "is above --max-lora-rank 16",
        ),
        ({"lora_name": "x", "lora_path": str(adapter_dirs["other-base"])}, "do not fit the base model"),
        ({"lora_name": "sql", "lora_path": str(adapter_dirs["tone"])}, "'sql' has already been loaded"),
        (
            {"lora_name": server.model_name, "lora_path": str(adapter_dirs["tone"])},
            "is the base model's name",
        ),
        ({"lora_name": "x", "lora_path": ""}, "Both 'lora_name' and 'lora_path' must be provided."),
        ({"lora_name": "x"}, "lora_path: Field required"),
    ]
    for body, problem in cases:
        status, message = error_of(post(server, "/v1/load_lora_adapter", body))
        assert status == 400 and problem in message, (body, message)
    ids = {model.id for model in client_of(server).models.list().data}
    assert ids == {server.model_name, "sql"}
    assert complete(client_of(server), "sql").choices[0].text == offline["sql"]


def test_the_routes_need_the_api_key(server, adapter_dirs) -> None:
    response = httpx.post(
        f"{server.base_url}/v1/load_lora_adapter",
        json={"lora_name": "tone", "lora_path": str(adapter_dirs["tone"])},
        timeout=30,
    )
    assert response.status_code == 401
    assert "tone" not in {model.id for model in client_of(server).models.list().data}


def lora_info(server: LiveServer) -> tuple[dict[str, str], float]:
    [(labels, value)] = [
        (dict(labels), value)
        for (name, labels), value in scrape(server.base_url).items()
        if name == LORA_INFO
    ]
    return labels, value


def test_lora_requests_info_names_the_adapters_in_use_and_moves_while_requests_run(server) -> None:
    labels, idle_stamp = lora_info(server)
    assert labels["max_lora"] == "2"
    stop = threading.Event()

    def keep_busy() -> None:
        client = client_of(server)
        while not stop.is_set():
            complete(client, "sql")

    worker = threading.Thread(target=keep_busy, name="sql-requests", daemon=True)
    worker.start()
    try:
        seen: list[tuple[dict[str, str], float]] = []

        def running_on_sql() -> bool:
            seen.append(lora_info(server))
            return seen[-1][0]["running_lora_adapters"] == "sql"

        wait_for(running_on_sql, timeout_seconds=120, message="sql among the running adapters")
        busy_stamp = seen[-1][1]
        assert busy_stamp > idle_stamp
    finally:
        stop.set()
        worker.join(120)
    wait_for(
        lambda: lora_info(server)[0]["running_lora_adapters"] == "" and lora_info(server)[1] > busy_stamp,
        timeout_seconds=120,
        message="no adapter running, stamped later",
    )


DOC = Path(__file__).resolve().parents[3] / "docs" / "server.md"


def lora_section_blocks(language: str) -> list[str]:
    section = DOC.read_text().split("## LoRA adapters\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.DOTALL)


def run_documented(server: LiveServer, command: list[str], example: str, replacements: dict[str, str]) -> str:
    for old, new in {"http://localhost:8000": server.base_url, **replacements}.items():
        assert old in example, old
        example = example.replace(old, new)
    env = {**os.environ, "VLLM_API_KEY": API_KEY}
    result = subprocess.run([*command, example], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_the_documented_curl_calls_load_use_and_unload_an_adapter(server, adapter_dirs) -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    [example] = lora_section_blocks("sh")
    output = run_documented(server, ["bash", "-c"], example, {"/adapters/sql-v2": str(adapter_dirs["tone"])})
    added, removed = (
        "Success: LoRA adapter 'sql-v2' added successfully.",
        "Success: LoRA adapter 'sql-v2' removed successfully.",
    )
    assert output.startswith(added) and output.endswith(removed), output
    assert json.loads(output[len(added) : -len(removed)])["model"] == "sql-v2"


def test_the_documented_openai_example_lists_and_calls_an_adapter(server) -> None:
    [example] = lora_section_blocks("python")
    output = run_documented(server, [sys.executable, "-c"], example, {})
    models, reply = output.splitlines()
    assert f"('{server.model_name}', None)" in models and f"('sql', '{server.model_name}')" in models
    assert reply.startswith("sql '")

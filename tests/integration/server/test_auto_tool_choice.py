"""``tool_choice: "auto"`` end to end, on a model that does call a tool.

The server runs with ``--tool-call-parser hermes --enable-auto-tool-choice`` on a scripted
checkpoint (tests/support/scripted_model.py): its greedy answer to any chat is the Hermes call
below, so what the real engine generates is known and every assertion is exact. The parsed call
is read through the official ``openai`` client, streamed and not; with ``tool_choice: "none"``
the same text comes back as content, so the calls are the parser's work on what the model wrote.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.integration.server.live import LiveServer, serve_in_thread
from tests.support.scripted_model import make_scripted_model

MODEL = "scripted-hermes"
ARGUMENTS = {"city": "Paris", "unit": "celsius"}
CALL = json.dumps({"name": "get_weather", "arguments": ARGUMENTS})
SCRIPT = ["<tool_call>\n", CALL, "\n</tool_call>"]  # Hermes: one call per tag
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": sorted(properties)},
        },
    }
    for name, description, properties in (
        (
            "get_weather",
            "The weather in a city",
            {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        ),
        ("get_time", "The time in a timezone", {"timezone": {"type": "string"}}),
    )
]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    model_dir: Path = make_scripted_model(tmp_path_factory.mktemp("models") / MODEL, SCRIPT)
    with serve_in_thread(
        model_dir,
        max_model_len=1024,
        served_model_name=MODEL,
        app_options={"tool_call_parser": "hermes", "enable_auto_tool_choice": True},
    ) as live:
        yield client_of(live)


def client_of(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="EMPTY", max_retries=0, timeout=120)


def chat(client: openai.OpenAI, **options: Any) -> Any:
    fields = {"messages": QUESTION, "tools": TOOLS, "max_tokens": 64, "temperature": 0, **options}
    return client.chat.completions.create(model=MODEL, **fields)


@pytest.mark.parametrize("tool_choice", [openai.NOT_GIVEN, "auto"], ids=["tools alone", "auto"])
def test_auto_gives_the_call_the_model_wrote_as_tool_calls(client: openai.OpenAI, tool_choice: Any) -> None:
    choice = chat(client, tool_choice=tool_choice).choices[0]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    [call] = choice.message.tool_calls
    assert (call.type, call.function.name) == ("function", "get_weather")
    assert call.function.arguments == json.dumps(ARGUMENTS)
    assert json.loads(call.function.arguments) == ARGUMENTS
    assert re.fullmatch(r"call_[0-9a-f]{32}", call.id), call.id


def test_auto_streams_the_call_once_it_is_complete(client: openai.OpenAI) -> None:
    pieces, content, finish_reasons = [], "", []
    for chunk in chat(client, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        pieces += delta.tool_calls or []
        finish_reasons += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
    assert (content, finish_reasons) == ("", ["tool_calls"])
    [piece] = pieces  # a Hermes call is given out whole, at its end tag
    assert (piece.index, piece.type, piece.function.name) == (0, "function", "get_weather")
    assert json.loads(piece.function.arguments) == ARGUMENTS
    assert re.fullmatch(r"call_[0-9a-f]{32}", piece.id), piece.id


def test_none_returns_what_the_model_wrote_as_text(client: openai.OpenAI) -> None:
    choice = chat(client, tool_choice="none").choices[0]
    assert choice.message.tool_calls is None
    assert (choice.finish_reason, choice.message.content) == ("stop", "".join(SCRIPT))

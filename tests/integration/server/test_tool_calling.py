"""Tool calling through the official ``openai`` SDK against a live server on the embedded model.

The server runs the real SmolLM2-135M-Instruct with ``--tool-call-parser smollm2
--enable-auto-tool-choice``. Its chat template does not render tools, so every request here also
exercises the server's own tools block. Each call is checked as a client would use it:
``json.loads`` of its arguments validated (``jsonschema``) against the parameters of the function
it names; streamed pieces are joined per ``index`` as SDK users join them. Greedy and short
(small ``max_tokens``), so the module stays quick on two cores. The examples of the "Tool calling"
section of docs/server.md are run here too, as written. ``tool_choice: "auto"`` is tested where
the model's answer is known to be a call: test_auto_tool_choice.py.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from kunlun_runtime.models.default_model import resolve_default_model
from tests.integration.server.live import LiveServer, serve_in_thread

MODEL = "SmolLM2-135M-Instruct"  # served under the embedded model's name, as the docs call it
KV_CACHE_MEMORY_BYTES = 192 << 20  # ten concurrent requests of ~300 tokens in float32, with room
MAX_TOKENS = 48  # every call below completes well within this
DOCS = Path(__file__).resolve().parents[3] / "docs" / "server.md"

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 32},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMETERS = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 32}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": WEATHER_PARAMETERS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a timezone",
            "parameters": TIME_PARAMETERS,
        },
    },
]
PARAMETERS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
GET_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with serve_in_thread(
        resolve_default_model(progress=False),
        kv_cache_memory_bytes=KV_CACHE_MEMORY_BYTES,
        max_model_len=1024,
        served_model_name=MODEL,
        app_options={"tool_call_parser": "smollm2", "enable_auto_tool_choice": True},
    ) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="EMPTY", max_retries=0, timeout=300)


def chat(client: openai.OpenAI, **options: Any) -> Any:
    fields = {"messages": QUESTION, "tools": TOOLS, "max_tokens": MAX_TOKENS, "temperature": 0, **options}
    return client.chat.completions.create(model=MODEL, **fields)


def assert_well_formed(name: str, arguments: str, call_id: str | None = None) -> None:
    """A call of one of the tools, with arguments that are an instance of its parameters."""
    assert name in PARAMETERS, name
    jsonschema.validate(json.loads(arguments), PARAMETERS[name])
    if call_id is not None:
        assert re.fullmatch(r"call_[0-9a-f]{32}", call_id), call_id


def streamed(client: openai.OpenAI, **options: Any) -> tuple[list[dict[str, Any]], str, str | None]:
    """A streamed reply joined as SDK users join it: calls by ``index``, content, finish reason."""
    calls: dict[int, dict[str, Any]] = {}
    content, finish_reason = "", None
    for chunk in chat(client, stream=True, **options):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        finish_reason = choice.finish_reason or finish_reason
        for piece in choice.delta.tool_calls or []:
            if piece.index not in calls:  # a call's first piece: id, type and name
                assert piece.id and piece.type == "function" and piece.function.name, piece
                calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
            else:
                assert piece.id is None and piece.function.name is None, piece
            calls[piece.index]["arguments"] += piece.function.arguments or ""
    return [calls[index] for index in sorted(calls)], content, finish_reason


def follow_up(client: openai.OpenAI, first: Any) -> Any:
    """The next turn after ``first``'s call: its message sent back as the SDK gave it, a result."""
    [call] = first.choices[0].message.tool_calls
    messages = [
        *QUESTION,
        first.choices[0].message,
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"celsius": 21})},
    ]
    return chat(client, messages=messages, tool_choice="none", max_tokens=8)


def docs_section_blocks(language: str) -> list[str]:
    """The ``language`` code blocks of docs/server.md's "Tool calling" section."""
    section = DOCS.read_text().split("\n## Tool calling\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.DOTALL)


def pointed_at(example: str, server: LiveServer) -> str:
    assert "http://localhost:8000" in example
    return example.replace("http://localhost:8000", server.base_url)


def run_docs_example(server: LiveServer, language: str) -> subprocess.CompletedProcess[str]:
    """The docs' curl (``bash``) or openai SDK (``python``) example, run as written."""
    blocks = [block for block in docs_section_blocks(language) if language != "bash" or "curl" in block]
    [example] = blocks
    command = ["bash", "-c"] if language == "bash" else [sys.executable, "-c"]
    return subprocess.run(
        [*command, pointed_at(example, server)], capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def replies(client: openai.OpenAI, server: LiveServer) -> Iterator[dict[str, concurrent.futures.Future[Any]]]:
    """Every generating request of this module, sent at once after the first: the engine batches
    them and the first put the prompt they share (tools block and question) into the prefix
    cache, so the module costs little more than its longest reply. Each test reads its own."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=12) as pool:
        replies = {"none": pool.submit(chat, client, tool_choice="none", max_tokens=8)}
        replies["none"].exception()  # done: its prompt is cached for the others
        replies |= {
            "named": pool.submit(chat, client, tool_choice=GET_WEATHER),
            "named streamed": pool.submit(streamed, client, tool_choice=GET_WEATHER),
            "required": pool.submit(chat, client, tool_choice="required"),
            "one required streamed": pool.submit(
                streamed, client, tool_choice="required", parallel_tool_calls=False
            ),
            "docs curl": pool.submit(run_docs_example, server, "bash"),
            "docs sdk": pool.submit(run_docs_example, server, "python"),
        }
        replies["follow-up"] = pool.submit(lambda: follow_up(client, replies["named"].result()))
        yield replies


def test_a_named_function_is_called_with_arguments_that_match_its_parameters(replies) -> None:
    choice = replies["named"].result().choices[0]
    assert (choice.finish_reason, choice.message.content) == ("stop", None)  # "stop" for named, as vLLM
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert_well_formed(call.function.name, call.function.arguments, call.id)


def test_a_named_call_streams_its_name_first_then_its_arguments(replies) -> None:
    calls, content, finish_reason = replies["named streamed"].result()
    assert (content, finish_reason, [call["name"] for call in calls]) == ("", "stop", ["get_weather"])
    assert_well_formed(calls[0]["name"], calls[0]["arguments"], calls[0]["id"])
    named = replies["named"].result().choices[0].message.tool_calls[0]
    assert calls[0]["arguments"] == named.function.arguments and calls[0]["id"] != named.id


def test_required_gives_calls_of_the_tools(replies) -> None:
    choice = replies["required"].result().choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) >= 1
    for call in choice.message.tool_calls:
        assert_well_formed(call.function.name, call.function.arguments, call.id)
    assert len({call.id for call in choice.message.tool_calls}) == len(choice.message.tool_calls)


def test_required_without_parallel_calls_streams_exactly_one_call(replies) -> None:
    calls, content, finish_reason = replies["one required streamed"].result()
    assert (len(calls), content, finish_reason) == (1, "", "tool_calls")
    assert_well_formed(calls[0]["name"], calls[0]["arguments"], calls[0]["id"])


def test_none_answers_in_text_without_calls(replies) -> None:
    choice = replies["none"].result().choices[0]
    assert choice.message.tool_calls is None and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")


def test_a_tool_result_is_taken_back_into_the_conversation_and_answered(replies) -> None:
    choice = replies["follow-up"].result().choices[0]
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason in ("stop", "length")


def test_the_docs_curl_example_returns_a_named_call(replies) -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    result = replies["docs curl"].result()
    assert result.returncode == 0, result.stderr
    [call] = json.loads(result.stdout)["choices"][0]["message"]["tool_calls"]
    assert_well_formed(call["function"]["name"], call["function"]["arguments"], call["id"])


def test_the_docs_openai_sdk_example_runs(replies) -> None:
    result = replies["docs sdk"].result()
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("get_weather {")


@pytest.mark.parametrize(
    ("options", "param", "words"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "get_news"}}}, "tool_choice", "get_news"),
        ({"tools": openai.NOT_GIVEN, "tool_choice": "required"}, "tool_choice", "`tools` must be set"),
        ({"tools": []}, "tools", "must not be an empty array"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "cannot be combined with tool_choice",
        ),
    ],
    ids=["unknown function", "tool_choice without tools", "empty tools", "two constraints"],
)
def test_a_bad_tools_request_is_a_400_naming_the_field(
    client: openai.OpenAI, options: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, **options)
    assert caught.value.param == param and words in caught.value.message


def test_auto_on_a_server_without_the_flags_is_a_400_naming_them(
    client: openai.OpenAI, server: LiveServer, replies
) -> None:
    concurrent.futures.wait(replies.values())  # no "auto" request of theirs sees the flag off
    assert server.lifecycle is not None and server.lifecycle.served is not None
    served = server.lifecycle.served
    served.enable_auto_tool_choice = False  # as if started without --enable-auto-tool-choice
    try:
        with pytest.raises(openai.BadRequestError) as caught:
            chat(client, tool_choice="auto")
    finally:
        served.enable_auto_tool_choice = True
    assert caught.value.param == "tool_choice"
    assert "--enable-auto-tool-choice and --tool-call-parser" in caught.value.message


@pytest.mark.parametrize(
    ("tool_choice", "field"),
    [
        ({"type": "function", "function": {"name": "broken"}}, "tools.2.function.parameters"),
        ("required", "tools"),
    ],
    ids=["named", "required"],
)
def test_an_invalid_parameters_schema_is_a_400_naming_the_tools_not_the_choice(
    client: openai.OpenAI, tool_choice: Any, field: str
) -> None:
    broken = {"type": "function", "function": {"name": "broken", "parameters": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, tools=[*TOOLS, broken], tool_choice=tool_choice)
    assert caught.value.body["param"] == field  # the SDK's body is the "error" object
    assert caught.value.body["message"].startswith(f"{field}: ")


def test_tokenize_counts_the_prompt_a_chat_with_tools_renders(
    client: openai.OpenAI, server: LiveServer
) -> None:
    asked = chat(client, tool_choice="none", max_tokens=1)

    def count(**fields: Any) -> int:
        response = httpx.post(
            f"{server.base_url}/tokenize", json={"messages": QUESTION, **fields}, timeout=60
        )
        assert response.status_code == 200, response.text
        return response.json()["count"]

    assert count(tools=TOOLS) == asked.usage.prompt_tokens
    assert count() < asked.usage.prompt_tokens  # the tools are part of the prompt
    empty = httpx.post(f"{server.base_url}/tokenize", json={"messages": QUESTION, "tools": []}, timeout=60)
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "tools"  # as chat answers it

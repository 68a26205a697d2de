"""tool_choice → plan (constraint, reader), the enforced schemas, the prompt with tools, the errors."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import pytest

from kunlun_runtime.engine.sampling_params import SamplingParams
from kunlun_runtime.errors import ConfigError, InvalidRequestError
from kunlun_runtime.models.tokenizer import Tokenizer
from kunlun_runtime.server.cli import SERVE
from kunlun_runtime.server.lifecycle import Lifecycle
from kunlun_runtime.server.protocol import ChatCompletionRequest
from kunlun_runtime.server.tool_calls import (
    AUTO_NEEDS_FLAGS,
    ToolPlan,
    build_prompt,
    constrain,
    plan_tools,
    required_schema,
    tools_system_block,
    validate_tool_flags,
)
from kunlun_runtime.server.tool_parsers import CallDelta, NamedCallParser, RequiredCallsParser, SmolLM2Parser
from kunlun_runtime.structured.params import StructuredOutputsParams
from tests.support.tiny_models import CHATML, build_tokenizer

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def make_request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **fields})


def make_plan(*, parser: str | None = "smollm2", auto: bool = True, **fields: Any) -> ToolPlan:
    return plan_tools(make_request(**fields), tool_call_parser=parser, enable_auto_tool_choice=auto)


def assert_refused(field: str, message: str, **fields: Any) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        make_plan(**fields)
    assert (caught.value.field, caught.value.status_code) == (field, 400)
    assert message in caught.value.message


# -- tool_choice → plan --------------------------------------------------------------------------------


def test_without_tools_nothing_is_enforced_or_read() -> None:
    plan = make_plan()
    assert (plan.kind, plan.tools, plan.constraint, plan.new_reader()) == ("none", (), None, None)


def test_tools_without_tool_choice_mean_auto_read_by_the_servers_parser() -> None:
    plan = make_plan(tools=[WEATHER])
    assert (plan.kind, plan.parser_name, plan.constraint) == ("auto", "smollm2", None)
    assert isinstance(plan.new_reader(), SmolLM2Parser)
    assert plan.tools == (WEATHER,)


def test_none_offers_the_tools_but_reads_no_calls() -> None:
    plan = make_plan(tools=[WEATHER], tool_choice="none")
    assert (plan.kind, plan.tools, plan.new_reader()) == ("none", (WEATHER,), None)


def test_a_named_function_is_enforced_by_its_parameters_schema() -> None:
    plan = make_plan(
        tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    assert plan.kind == "named" and plan.function_name == "get_weather"
    assert plan.constraint == StructuredOutputsParams(
        json=WEATHER_PARAMETERS, source="tools.0.function.parameters"
    )
    assert isinstance(plan.new_reader(), NamedCallParser)


def test_a_named_function_without_parameters_is_an_empty_object() -> None:
    plan = make_plan(tools=[CLOCK], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert plan.constraint == StructuredOutputsParams(
        json={"type": "object", "properties": {}}, source="tools.0.function.parameters"
    )


def test_required_is_enforced_as_an_array_of_calls_and_read_as_one() -> None:
    plan = make_plan(tools=[WEATHER], tool_choice="required", parser=None, auto=False)
    assert plan.kind == "required" and plan.constraint is not None
    assert plan.constraint.json == required_schema(
        make_request(tools=[WEATHER]).tools or [], parallel_tool_calls=True
    )
    assert isinstance(plan.new_reader(), RequiredCallsParser)


def test_an_empty_tools_list_is_refused() -> None:
    assert_refused("tools", "tools: must not be an empty array", tools=[])


def test_tool_choice_without_tools_is_refused_except_none() -> None:
    assert_refused("tool_choice", "`tools` must be set", tool_choice="required")
    assert make_plan(tool_choice="none").kind == "none"


def test_a_named_function_that_is_not_a_tool_is_refused() -> None:
    assert_refused(
        "tool_choice",
        "the function `get_time` is not one of the `tools` given",
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )


@pytest.mark.parametrize(("parser", "auto"), [(None, False), ("hermes", False), (None, True)])
def test_auto_needs_both_flags(parser: str | None, auto: bool) -> None:
    assert_refused(
        "tool_choice", AUTO_NEEDS_FLAGS, tools=[WEATHER], tool_choice="auto", parser=parser, auto=auto
    )
    assert "--enable-auto-tool-choice" in AUTO_NEEDS_FLAGS and "--tool-call-parser" in AUTO_NEEDS_FLAGS


# -- the schemas -----------------------------------------------------------------------------------------


def call_item(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "parameters": parameters},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }


def test_required_schema_is_an_array_of_any_tools_call() -> None:
    tools = make_request(tools=[WEATHER, CLOCK]).tools or []
    assert required_schema(tools, parallel_tool_calls=True) == {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                call_item("get_weather", WEATHER_PARAMETERS),
                call_item("get_time", {"type": "object", "properties": {}}),
            ]
        },
    }
    assert required_schema(tools, parallel_tool_calls=False)["maxItems"] == 1


def test_required_schema_moves_each_tools_defs_to_the_root() -> None:
    parameters = {
        "type": "object",
        "properties": {"at": {"$ref": "#/$defs/place"}},
        "$defs": {"place": {"type": "string"}},
    }
    tools = make_request(
        tools=[{"type": "function", "function": {"name": "go", "parameters": parameters}}]
    ).tools
    schema = required_schema(tools or [], parallel_tool_calls=True)
    assert schema["$defs"] == {"place": {"type": "string"}}
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == {
        "type": "object",
        "properties": {"at": {"$ref": "#/$defs/place"}},
    }
    assert "$defs" in parameters  # the request's own schema is left as it was


def test_required_schema_refuses_clashing_defs() -> None:
    def tool(name: str, kind: str) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": name, "parameters": {"$defs": {"x": {"type": kind}}}},
        }

    tools = make_request(tools=[tool("a", "string"), tool("b", "integer")]).tools or []
    with pytest.raises(InvalidRequestError, match="two tools define `\\$defs/x` differently") as caught:
        required_schema(tools, parallel_tool_calls=True)
    assert caught.value.field == "tools"


# -- the constraint and the answer ------------------------------------------------------------------------


def test_the_constraint_joins_the_sampling_params() -> None:
    plan = make_plan(tools=[WEATHER], tool_choice="required")
    assert constrain(SamplingParams(max_tokens=5), plan).structured_outputs == plan.constraint
    plain = SamplingParams(max_tokens=5)
    assert constrain(plain, make_plan(tools=[WEATHER])) is plain


def test_a_response_format_with_an_enforced_tool_choice_is_refused_naming_it() -> None:
    params = SamplingParams(
        structured_outputs=StructuredOutputsParams(json_object=True, source="response_format")
    )
    with pytest.raises(InvalidRequestError, match="cannot be combined with tool_choice required") as caught:
        constrain(params, make_plan(tools=[WEATHER], tool_choice="required"))
    assert caught.value.field == "response_format"


@pytest.mark.parametrize(
    ("kind", "engine_reason", "num_calls", "answer"),
    [
        ("auto", "stop", 1, "tool_calls"),
        ("auto", "stop", 0, "stop"),
        ("auto", "length", 1, "length"),
        ("required", "stop", 2, "tool_calls"),
        ("named", "stop", 1, "stop"),
        ("none", "stop", 0, "stop"),
        ("auto", None, 1, None),
    ],
)
def test_finish_reason_follows_vllm(
    kind: str, engine_reason: str | None, num_calls: int, answer: str | None
) -> None:
    assert ToolPlan(kind).finish_reason(engine_reason, num_calls) == answer  # type: ignore[arg-type]


def test_without_parallel_tool_calls_only_the_first_call_is_kept() -> None:
    assert [ToolPlan("auto", parallel_tool_calls=False).keeps(CallDelta(i, "f", "{}")) for i in (0, 1)] == [
        True,
        False,
    ]
    assert ToolPlan("auto").keeps(CallDelta(1, "f", "{}"))


# -- the prompt ------------------------------------------------------------------------------------------

HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
]


def test_a_template_that_renders_tools_gets_them_and_the_calls_as_hf_passes_them() -> None:
    body = make_request(tools=[WEATHER])
    body = body.model_copy(update={"messages": make_request(messages=HISTORY).messages})
    conversation, kwargs = build_prompt(body.messages, make_plan(tools=[WEATHER]), renders_tools=True)
    assert kwargs == {"tools": [WEATHER]}
    assert conversation == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": "22 C", "tool_call_id": "call_1"},
    ]


def test_a_template_without_tools_gets_them_in_the_system_message_in_the_familys_format() -> None:
    messages = make_request(messages=HISTORY).messages
    conversation, kwargs = build_prompt(messages, make_plan(tools=[WEATHER]), renders_tools=False)
    block = tools_system_block((WEATHER,), "smollm2")
    assert kwargs == {}
    assert conversation == [
        {"role": "system", "content": f"Be brief.\n\n{block}"},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>',
        },
        {"role": "user", "content": "<tool_response>\n22 C\n</tool_response>"},
    ]
    functions = json.dumps([WEATHER["function"]])
    assert f"<tools>{functions}</tools>" in block and "<tool_call>[{" in block


def test_without_a_system_message_the_tools_get_one_of_their_own() -> None:
    conversation, _ = build_prompt(
        make_request().messages, make_plan(tools=[CLOCK], parser="hermes"), renders_tools=False
    )
    assert conversation[0] == {"role": "system", "content": tools_system_block((CLOCK,), "hermes")}
    assert conversation[1:] == USER


@pytest.mark.parametrize(
    ("prompt_format", "written"),
    [
        ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    ],
)
def test_earlier_calls_are_written_as_the_family_writes_them(prompt_format: str, written: str) -> None:
    plan = make_plan(tools=[WEATHER], parser=prompt_format)
    conversation, _ = build_prompt(make_request(messages=HISTORY).messages, plan, renders_tools=False)
    assert conversation[2] == {"role": "assistant", "content": written}


def test_call_arguments_that_are_not_json_are_refused_naming_them() -> None:
    history = [
        *HISTORY[:2],
        {
            **HISTORY[2],
            "tool_calls": [{**HISTORY[2]["tool_calls"][0], "function": {"name": "f", "arguments": "{oops"}}],
        },
    ]
    with pytest.raises(InvalidRequestError) as caught:
        build_prompt(make_request(messages=history).messages, make_plan(), renders_tools=True)
    assert caught.value.field == "messages.2.tool_calls.0.function.arguments"


# -- the tokenizer -----------------------------------------------------------------------------------------

TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS={{ tools | map(attribute='function.name') | join(',') }}\n{% endif %}" + CHATML
)


def make_tokenizer(directory: Path, template: str) -> Tokenizer:
    directory.mkdir()
    build_tokenizer().save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return Tokenizer(directory)


def test_the_tokenizer_knows_whether_its_template_renders_tools(tmp_path: Path) -> None:
    assert make_tokenizer(tmp_path / "chatml", CHATML).renders_tools is False
    tokenizer = make_tokenizer(tmp_path / "tools", TOOLS_TEMPLATE)
    assert tokenizer.renders_tools is True
    assert tokenizer.render_chat(USER, tools=[WEATHER, CLOCK]).startswith("TOOLS=get_weather,get_time\n")
    assert tokenizer.render_chat(USER).startswith("<|im_start|>user")


# -- the flags -------------------------------------------------------------------------------------------


def test_serve_takes_vllms_two_tool_flags() -> None:
    parser = argparse.ArgumentParser()
    SERVE.configure(parser)
    args = parser.parse_args(["--tool-call-parser", "smollm2", "--enable-auto-tool-choice"])
    assert (args.tool_call_parser, args.enable_auto_tool_choice) == ("smollm2", True)
    defaults = parser.parse_args([])
    assert (defaults.tool_call_parser, defaults.enable_auto_tool_choice) == (None, False)


@pytest.mark.parametrize(
    ("parser", "auto", "field", "message"),
    [
        (
            "mistral",
            False,
            "tool_call_parser",
            "unknown parser 'mistral' (choices: hermes, llama3_json, smollm2)",
        ),
        (None, True, "enable_auto_tool_choice", "--enable-auto-tool-choice requires --tool-call-parser"),
    ],
)
def test_bad_tool_flags_stop_the_server_from_being_built(
    parser: str | None, auto: bool, field: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as caught:
        Lifecycle(lambda: None, tool_call_parser=parser, enable_auto_tool_choice=auto)  # type: ignore[arg-type,return-value]
    assert caught.value.field == field
    validate_tool_flags("hermes", True)
    validate_tool_flags(None, False)


def test_arguments_nested_beyond_the_stack_are_a_400_naming_them_not_a_500() -> None:
    deep = "[" * 100_000 + "]" * 100_000
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep}}
                    ],
                },
            ]
        }
    )
    plan = plan_tools(body, tool_call_parser=None, enable_auto_tool_choice=False)
    with pytest.raises(InvalidRequestError, match="nested too deeply") as error:
        build_prompt(body.messages, plan, renders_tools=True)
    assert error.value.field == "messages.1.tool_calls.0.function.arguments"

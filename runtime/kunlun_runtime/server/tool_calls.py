"""Tool calling for chat completions: ``tool_choice`` → what is enforced and how output is read;
``tools`` and tool messages → what the chat template renders.

``plan_tools`` checks the request's ``tools``/``tool_choice`` the way vLLM does and returns a
``ToolPlan``: a named function or ``required`` becomes a JSON-Schema constraint the grammar engine
enforces (``StructuredOutputsParams`` with source ``tool_choice``); ``auto`` reads free text with
the server's ``--tool-call-parser``; ``none`` reads nothing. ``build_prompt`` gives the template
the tools as HF's ``apply_chat_template`` does (``tools=[{"type": "function", "function":
{...}}]``) when the template uses ``tools``, and otherwise writes them into the system message
itself, with earlier calls and tool results in the format of the family named by the parser.

Pure: nothing is compiled or tokenized here. Every error is an InvalidRequestError naming the
field the client sent.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from kunlun_runtime.engine.sampling_params import SamplingParams
from kunlun_runtime.errors import ConfigError, InvalidRequestError
from kunlun_runtime.server.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice, Tool
from kunlun_runtime.server.tool_parsers import (
    TOOL_CALL_PARSERS,
    CallDelta,
    NamedCallParser,
    ReadsToolCalls,
    RequiredCallsParser,
    make_tool_call_parser,
)
from kunlun_runtime.structured.params import StructuredOutputsParams

ToolChoiceKind = Literal["none", "auto", "required", "named"]

# vLLM's words, which clients look for to know that the server does not serve "auto".
AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
NO_ARGUMENTS_SCHEMA: dict[str, Any] = {"type": "object", "properties": {}}
DEFAULT_PROMPT_FORMAT = "hermes"  # the fallback rendering when the server names no parser


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one request's tools are offered, enforced and read back."""

    kind: ToolChoiceKind
    tools: tuple[dict[str, Any], ...] = ()  # as chat templates take them; empty without tools
    function_name: str | None = None  # the named function (kind "named")
    constraint: StructuredOutputsParams | None = None  # what the output must match (required, named)
    parser_name: str | None = None  # the --tool-call-parser that reads "auto" output
    prompt_format: str = DEFAULT_PROMPT_FORMAT  # the family whose format the fallback writes
    parallel_tool_calls: bool = True  # False: only the first call is answered

    def new_reader(self) -> ReadsToolCalls | None:
        """A fresh reader of one output's calls; None when output is plain content."""
        if self.kind == "named":
            assert self.function_name is not None
            return NamedCallParser(self.function_name)
        if self.kind == "required":
            return RequiredCallsParser()
        if self.kind == "auto":
            assert self.parser_name is not None
            return make_tool_call_parser(self.parser_name)
        return None

    def keeps(self, call: CallDelta) -> bool:
        """Whether ``call`` is answered: with parallel_tool_calls false only the first is (vLLM)."""
        return self.parallel_tool_calls or call.index == 0

    def finish_reason(self, engine_reason: str | None, num_calls: int) -> str | None:
        """OpenAI's finish reason: "tool_calls" when auto or required made calls and the output
        ended on its own; a named call keeps "stop" (vLLM and OpenAI do the same)."""
        if engine_reason == "stop" and num_calls > 0 and self.kind in ("auto", "required"):
            return "tool_calls"
        return engine_reason


def validate_tool_flags(tool_call_parser: str | None, enable_auto_tool_choice: bool) -> None:
    """Check the server's two tool flags. Raises ConfigError naming the flag: an unknown parser;
    auto tool choice without a parser to read its calls (vLLM refuses to start likewise)."""
    if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
        choices = ", ".join(sorted(TOOL_CALL_PARSERS))
        raise ConfigError(
            f"--tool-call-parser: unknown parser {tool_call_parser!r} (choices: {choices})",
            field="tool_call_parser",
        )
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ConfigError(
            "--enable-auto-tool-choice requires --tool-call-parser", field="enable_auto_tool_choice"
        )


def plan_tools(
    body: ChatCompletionRequest, *, tool_call_parser: str | None, enable_auto_tool_choice: bool
) -> ToolPlan:
    """The plan for ``body``'s tools. Without ``tool_choice``, tools mean "auto" and no tools "none".

    Raises:
        InvalidRequestError: an empty ``tools`` list; a ``tool_choice`` other than "none" without
            ``tools``; a named function not in ``tools``; "auto" on a server started without
            ``--enable-auto-tool-choice`` and ``--tool-call-parser``; tools whose ``$defs`` clash
            (required).
    """
    tools = body.tools
    if tools is not None and not tools:
        raise InvalidRequestError(
            "tools: must not be an empty array; give at least one tool or omit the field", field="tools"
        )
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    common: dict[str, Any] = {
        "tools": tuple(tool.model_dump(exclude_none=True) for tool in tools or ()),
        "prompt_format": tool_call_parser or DEFAULT_PROMPT_FORMAT,
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    if choice == "none":
        return ToolPlan("none", **common)
    if not tools:
        raise InvalidRequestError(
            "tool_choice: `tools` must be set when using tool_choice", field="tool_choice"
        )
    if isinstance(choice, NamedToolChoice):
        index = named_tool_index(tools, choice.function.name)
        schema = copy.deepcopy(tools[index].function.parameters or NO_ARGUMENTS_SCHEMA)
        # An invalid schema is the tool's fault, not the choice's: errors name its parameters.
        constraint = StructuredOutputsParams(json=schema, source=f"tools.{index}.function.parameters")
        return ToolPlan("named", function_name=choice.function.name, constraint=constraint, **common)
    if choice == "required":
        schema = required_schema(tools, parallel_tool_calls=body.parallel_tool_calls)
        return ToolPlan("required", constraint=StructuredOutputsParams(json=schema, source="tools"), **common)
    if not (enable_auto_tool_choice and tool_call_parser):
        raise InvalidRequestError(f"tool_choice: {AUTO_NEEDS_FLAGS}", field="tool_choice")
    return ToolPlan("auto", parser_name=tool_call_parser, **common)


def named_tool_index(tools: Sequence[Tool], name: str) -> int:
    """The index of the tool named ``name``, whose ``parameters`` (no parameters: an empty object)
    a named call's output follows. Raises InvalidRequestError naming ``tool_choice`` when none is."""
    for index, tool in enumerate(tools):
        if tool.function.name == name:
            return index
    raise InvalidRequestError(
        f"tool_choice: the function `{name}` is not one of the `tools` given", field="tool_choice"
    )


def required_schema(tools: Sequence[Tool], *, parallel_tool_calls: bool) -> dict[str, Any]:
    """The schema of a "required" output: a JSON array of at least one (exactly one without
    parallel tool calls) ``{"name": <a tool's name>, "parameters": <its parameters>}`` objects.
    Each tool's ``$defs`` move to the root, where its ``#/$defs/...`` references now point.

    Raises InvalidRequestError naming ``tools`` when two tools define one ``$defs`` name apart."""
    items: list[dict[str, Any]] = []
    defs: dict[str, Any] = {}
    for tool in tools:
        parameters = copy.deepcopy(tool.function.parameters or NO_ARGUMENTS_SCHEMA)
        tool_defs = parameters.pop("$defs", {})
        if not isinstance(tool_defs, dict):
            raise InvalidRequestError(
                "tools: `$defs` of a function's parameters must be an object", field="tools"
            )
        for def_name, definition in tool_defs.items():
            if defs.setdefault(def_name, definition) != definition:
                raise InvalidRequestError(
                    f"tools: two tools define `$defs/{def_name}` differently", field="tools"
                )
        items.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.function.name}, "parameters": parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def constrain(params: SamplingParams, plan: ToolPlan) -> SamplingParams:
    """``params`` with the plan's constraint. Raises InvalidRequestError naming the other
    constraint's field when the request has one too (response_format, structured_outputs, ...)."""
    if plan.constraint is None:
        return params
    other = params.structured_outputs
    if other is not None:
        choice = "required" if plan.kind == "required" else "a named function"
        raise InvalidRequestError(
            f"{other.source}: cannot be combined with tool_choice {choice}, which constrains the "
            "output itself; use one or the other",
            field=other.source,
        )
    return replace(params, structured_outputs=plan.constraint)


def build_prompt(
    messages: Sequence[ChatMessage], plan: ToolPlan, *, renders_tools: bool
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The conversation for the chat template and the template variables the tools add.

    A template that uses ``tools`` gets them as a variable, assistant calls as ``tool_calls``
    (arguments decoded, as HF templates expect) and ``tool`` messages as they are. Otherwise the
    tools go into the system message (``tools_system_block``), calls into the assistant's text and
    tool results into user turns, in the format of ``plan.prompt_format``'s family.

    Raises InvalidRequestError naming ``messages.<i>.tool_calls.<j>.function.arguments`` for
    arguments that are not JSON.
    """
    conversation = [_message(m, i, plan.prompt_format, renders_tools) for i, m in enumerate(messages)]
    if not plan.tools:
        return conversation, {}
    if renders_tools:
        return conversation, {"tools": list(plan.tools)}
    block = tools_system_block(plan.tools, plan.prompt_format)
    if conversation and conversation[0]["role"] == "system":
        first = conversation[0]
        conversation[0] = {
            **first,
            "content": f"{first['content']}\n\n{block}" if first["content"] else block,
        }
    else:
        conversation.insert(0, {"role": "system", "content": block})
    return conversation, {}


def _message(message: ChatMessage, index: int, prompt_format: str, renders_tools: bool) -> dict[str, Any]:
    item: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.name is not None:
        item["name"] = message.name
    if message.role == "tool":
        if renders_tools:
            return {**item, "tool_call_id": message.tool_call_id} if message.tool_call_id else item
        return {"role": "user", "content": f"<tool_response>\n{item['content']}\n</tool_response>"}
    if message.role != "assistant" or not message.tool_calls:
        return item
    calls: list[dict[str, Any]] = []
    for number, call in enumerate(message.tool_calls):
        field = f"messages.{index}.tool_calls.{number}.function.arguments"
        try:
            arguments = json.loads(call.function.arguments) if call.function.arguments.strip() else {}
        except json.JSONDecodeError as error:
            raise InvalidRequestError(f"{field}: not JSON ({error})", field=field) from error
        except RecursionError:
            raise InvalidRequestError(f"{field}: nested too deeply", field=field) from None
        function = {"name": call.function.name, "arguments": arguments}
        calls.append({"id": call.id, "type": "function", "function": function})
    if renders_tools:
        return {**item, "tool_calls": calls}
    written = _written_calls(
        [(c["function"]["name"], c["function"]["arguments"]) for c in calls], prompt_format
    )
    return {**item, "content": f"{item['content']}\n{written}" if item["content"] else written}


def tools_system_block(tools: Sequence[dict[str, Any]], prompt_format: str) -> str:
    """The system text that offers ``tools`` to a model whose template cannot, in the call format
    its family (``prompt_format``, a parser's name) was trained on. Our own wording."""
    functions = [tool["function"] for tool in tools]
    intro = "You can call functions (tools) to help with the user's request."
    if prompt_format == "smollm2":
        return (
            f"{intro} They are listed here as JSON:\n<tools>{json.dumps(functions, ensure_ascii=False)}</tools>\n"
            "To call functions, answer with nothing but a JSON list of the calls inside tags, like "
            '<tool_call>[{"name": "<function name>", "arguments": {<the arguments as JSON>}}]</tool_call>\n'
            "If no function fits, answer in plain text."
        )
    listing = "\n".join(json.dumps(function, ensure_ascii=False) for function in functions)
    if prompt_format == "llama3_json":
        return (
            f"{intro} Their descriptions, one JSON object per line:\n{listing}\n"
            'To call one, answer with nothing but the JSON object {"name": "<function name>", '
            '"parameters": {<the arguments as JSON>}}; separate several calls with ";". '
            "If no function fits, answer in plain text."
        )
    return (
        f"{intro} Their descriptions, one JSON object per line:\n<tools>\n{listing}\n</tools>\n"
        "To call one, write its name and arguments as JSON inside tags, one call per tag:\n"
        '<tool_call>\n{"name": "<function name>", "arguments": {<the arguments as JSON>}}\n</tool_call>\n'
        "If no function fits, answer in plain text."
    )


def _written_calls(calls: list[tuple[str, Any]], prompt_format: str) -> str:
    """An assistant's earlier calls as the family writes them in its own answers."""
    if prompt_format == "smollm2":
        items = [{"name": name, "arguments": arguments} for name, arguments in calls]
        return f"<tool_call>{json.dumps(items, ensure_ascii=False)}</tool_call>"
    if prompt_format == "llama3_json":
        return "; ".join(
            json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)
            for name, arguments in calls
        )
    return "\n".join(
        f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n</tool_call>"
        for name, arguments in calls
    )

"""Tool-call parsers: each family's output → content and calls, whole and streamed in pieces.

Every case is run three ways: fed at once, one character at a time and in pieces of 7 characters;
the content and the calls must be the same each time (a stream and a non-streamed answer agree).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kunlun_runtime.server.tool_parsers import (
    TOOL_CALL_PARSERS,
    CallDelta,
    HermesParser,
    Llama3JsonParser,
    NamedCallParser,
    ReadsToolCalls,
    RequiredCallsParser,
    SmolLM2Parser,
    make_tool_call_parser,
)

PIECE_SIZES = (None, 1, 7)  # None: the whole text at once
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
WEATHER_ARGS = '{"city": "Paris", "unit": "celsius"}'


def parse(reader: ReadsToolCalls, text: str, piece_size: int | None) -> tuple[str, list[CallDelta]]:
    """``text`` fed in pieces of ``piece_size`` then finished: all content and all call pieces."""
    pieces = (
        [text] if piece_size is None else [text[i : i + piece_size] for i in range(0, len(text), piece_size)]
    )
    steps = [reader.feed(piece) for piece in pieces] + [reader.finish()]
    return "".join(step.content for step in steps), [call for step in steps for call in step.calls]


def whole_calls(pieces: list[CallDelta]) -> list[tuple[str, str]]:
    """Call pieces joined into (name, arguments) per call, as a client joins streamed pieces."""
    calls: dict[int, list[str]] = {}
    for piece in pieces:
        if piece.name is not None:
            calls[piece.index] = [piece.name, ""]
        calls[piece.index][1] += piece.arguments
    return [(name, arguments) for name, arguments in calls.values()]


CASES: list[tuple[str, Callable[[], ReadsToolCalls], str, str, list[tuple[str, str]]]] = [
    # (id, parser factory, output, content, calls)
    (
        "hermes one call",
        HermesParser,
        f"<tool_call>\n{WEATHER}\n</tool_call>",
        "",
        [("get_weather", WEATHER_ARGS)],
    ),
    (
        "hermes text then two calls",
        HermesParser,
        f'Let me check.\n<tool_call>{WEATHER}</tool_call>\n<tool_call>{{"name": "get_time"}}</tool_call>\n',
        "Let me check.\n",
        [("get_weather", WEATHER_ARGS), ("get_time", "{}")],
    ),
    (
        "hermes call without end tag",
        HermesParser,
        f"<tool_call>{WEATHER}",
        "",
        [("get_weather", WEATHER_ARGS)],
    ),
    ("hermes no call", HermesParser, "It is sunny; 1 < 2 <tool", "It is sunny; 1 < 2 <tool", []),
    (
        "hermes bad json",
        HermesParser,
        "<tool_call>{oops}</tool_call> bye",
        "<tool_call>{oops}</tool_call> bye",
        [],
    ),
    (
        "hermes call without a name",
        HermesParser,
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',
        [],
    ),
    (
        "hermes arguments as a json string",
        HermesParser,
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',
        "",
        [("f", '{"x": 1}')],
    ),
    (
        "hermes good call then a cut-off one",
        HermesParser,
        f'<tool_call>{WEATHER}</tool_call>\n<tool_call>{{"name": "get_ti',
        '\n<tool_call>{"name": "get_ti',
        [("get_weather", WEATHER_ARGS)],
    ),
    (
        "smollm2 list of one",
        SmolLM2Parser,
        f"<tool_call>[{WEATHER}]</tool_call>",
        "",
        [("get_weather", WEATHER_ARGS)],
    ),
    (
        "smollm2 list of two",
        SmolLM2Parser,
        f'<tool_call>[\n{WEATHER},\n{{"name": "get_time", "arguments": {{"timezone": "UTC"}}}}\n]</tool_call>',
        "",
        [("get_weather", WEATHER_ARGS), ("get_time", '{"timezone": "UTC"}')],
    ),
    (
        "smollm2 lone object",
        SmolLM2Parser,
        f"<tool_call>{WEATHER}</tool_call>",
        "",
        [("get_weather", WEATHER_ARGS)],
    ),
    ("smollm2 empty list", SmolLM2Parser, "<tool_call>[]</tool_call>", "<tool_call>[]</tool_call>", []),
    (
        "smollm2 one bad item spoils the tag",
        SmolLM2Parser,
        f'<tool_call>[{WEATHER}, {{"nom": "x"}}]</tool_call>',
        f'<tool_call>[{WEATHER}, {{"nom": "x"}}]</tool_call>',
        [],
    ),
    ("smollm2 plain answer", SmolLM2Parser, "Paris is sunny.", "Paris is sunny.", []),
    (
        "llama3 object",
        Llama3JsonParser,
        ' {"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        "",
        [("get_weather", WEATHER_ARGS)],
    ),
    (
        "llama3 python tag and two calls",
        Llama3JsonParser,
        '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}};',
        "",
        [("a", '{"x": 1}'), ("b", "{}")],
    ),
    (
        "llama3 arguments key",
        Llama3JsonParser,
        '{"name": "a", "arguments": {"x": 1}}',
        "",
        [("a", '{"x": 1}')],
    ),
    (
        "llama3 json inside prose stays content",
        Llama3JsonParser,
        'Use {"name": "a", "parameters": {}} like this.',
        'Use {"name": "a", "parameters": {}} like this.',
        [],
    ),
    ("llama3 object that is not a call", Llama3JsonParser, '{"a": 1} ok', '{"a": 1} ok', []),
    ("llama3 cut off", Llama3JsonParser, '{"name": "a", "param', '{"name": "a", "param', []),
    ("llama3 text after a call", Llama3JsonParser, '{"name": "a"} done', " done", [("a", "{}")]),
    (
        "required array",
        RequiredCallsParser,
        f'[{{"name": "get_weather", "parameters": {WEATHER_ARGS}}}, {{"name": "get_time", "parameters": {{}}}}]',
        "",
        [("get_weather", WEATHER_ARGS), ("get_time", "{}")],
    ),
    (
        "required array cut off",
        RequiredCallsParser,
        '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "para',
        '{"name": "b", "para',
        [("a", '{"x": 1}')],
    ),
    ("required not an array", RequiredCallsParser, "no calls", "no calls", []),
    (
        "named arguments",
        lambda: NamedCallParser("get_weather"),
        WEATHER_ARGS,
        "",
        [("get_weather", WEATHER_ARGS)],
    ),
    ("named without output", lambda: NamedCallParser("get_time"), "", "", [("get_time", "")]),
]


@pytest.mark.parametrize("piece_size", PIECE_SIZES, ids=lambda size: f"pieces={size}")
@pytest.mark.parametrize(
    ("factory", "output", "content", "calls"), [case[1:] for case in CASES], ids=[c[0] for c in CASES]
)
def test_output_is_read_into_content_and_calls(
    factory: Callable[[], ReadsToolCalls],
    output: str,
    content: str,
    calls: list[tuple[str, str]],
    piece_size: int | None,
) -> None:
    got_content, pieces = parse(factory(), output, piece_size)
    assert (got_content, whole_calls(pieces)) == (content, calls)
    assert [piece.index for piece in pieces if piece.name is not None] == list(range(len(calls)))


def test_content_before_a_call_streams_at_once_and_a_partial_tag_is_held_back() -> None:
    parser = HermesParser()
    assert parser.feed("Sure, ").content == "Sure, "
    assert parser.feed("checking <tool").content == "checking "
    step = parser.feed(f"_call>{WEATHER}</tool_call>")
    assert (step.content, step.calls) == ("", (CallDelta(0, "get_weather", WEATHER_ARGS),))


def test_a_call_is_given_out_as_soon_as_it_is_complete() -> None:
    parser = SmolLM2Parser()
    assert parser.feed(f"<tool_call>[{WEATHER}").calls == ()
    assert parser.feed("]</tool_call>").calls == (CallDelta(0, "get_weather", WEATHER_ARGS),)
    required = RequiredCallsParser()
    assert required.feed('[{"name": "a", "parameters": {}}').calls == (CallDelta(0, "a", "{}"),)
    assert required.feed(', {"name": "b", "parameters": {}}]').calls == (CallDelta(1, "b", "{}"),)


def test_named_arguments_stream_with_the_name_on_the_first_piece_only() -> None:
    parser = NamedCallParser("get_time")
    assert parser.feed('{"timezone": ').calls == (CallDelta(0, "get_time", '{"timezone": '),)
    assert parser.feed('"UTC"}').calls == (CallDelta(0, None, '"UTC"}'),)
    assert parser.finish().calls == ()


def test_blank_text_between_and_after_calls_is_not_content() -> None:
    content, pieces = parse(
        HermesParser(), f"<tool_call>{WEATHER}</tool_call>\n\n<tool_call>{WEATHER}</tool_call>\n", 3
    )
    assert (content, len(pieces)) == ("", 2)


def test_the_registry_names_the_parsers_and_refuses_an_unknown_one() -> None:
    assert sorted(TOOL_CALL_PARSERS) == ["hermes", "llama3_json", "smollm2"]
    assert isinstance(make_tool_call_parser("smollm2"), SmolLM2Parser)
    with pytest.raises(
        ValueError, match=r"unknown tool call parser 'mistral' \(choices: hermes, llama3_json, smollm2\)"
    ):
        make_tool_call_parser("mistral")


@pytest.mark.parametrize("name", ["hermes", "smollm2", "llama3_json"])
def test_output_nested_beyond_the_stack_is_content_not_a_crash(name: str) -> None:
    deep = '{"name": "f", "arguments": ' + "[" * 50_000 + "]" * 50_000 + "}"
    text = {"hermes": f"<tool_call>{deep}</tool_call>", "smollm2": f"<tool_call>[{deep}]</tool_call>"}.get(
        name, deep
    )
    parser = make_tool_call_parser(name)
    steps = [parser.feed(text), parser.finish()]
    assert not any(step.calls for step in steps)
    assert "".join(step.content for step in steps) == text

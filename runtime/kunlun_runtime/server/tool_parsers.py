"""Tool-call parsers: a model's output text → the content in it and the tool calls in it.

One parser per model family, chosen with ``--tool-call-parser`` (``TOOL_CALL_PARSERS``), and the
two that read an enforced ``tool_choice`` (``NamedCallParser``, ``RequiredCallsParser``). Every
parser is incremental and holds one output's state: ``feed`` takes the text the model just added,
``finish`` says there is no more; both return a ``ParseStep``. A non-streaming answer is one
``feed`` of the whole text and ``finish``, so streamed and non-streamed answers agree by
construction.

Pure: no tokenizer, no I/O. Invariant: output that does not form a well-formed call (bad JSON, no
function name, a call cut off by max_tokens) is given back as content, never dropped; only the
markers around well-formed calls and the blank text between calls are.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

_DECODER = json.JSONDecoder()
_BLANK = " \t\r\n"
_SEPARATORS = _BLANK + ";"  # between Llama 3 JSON calls


@dataclass(frozen=True, slots=True)
class CallDelta:
    """A piece of one tool call: a whole call, or (named tool_choice) a fragment of its arguments."""

    index: int  # the call's position among this output's calls
    name: str | None  # the function's name on the call's first piece, None on later ones
    arguments: str  # JSON text of the arguments (a fragment of it on a streamed piece)


@dataclass(frozen=True, slots=True)
class ParseStep:
    content: str = ""  # text for ``message.content``
    calls: tuple[CallDelta, ...] = ()


def call_of(payload: Any, argument_keys: tuple[str, ...] = ("arguments",)) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of one decoded call object, or None when it is not one: it needs
    a non-empty string ``name`` and arguments (under the first of ``argument_keys`` present) that
    are a JSON object, or absent (no arguments)."""
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str) or not payload["name"]:
        return None
    key = next((k for k in argument_keys if k in payload), None)
    arguments = payload[key] if key is not None else {}
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):  # nesting deeper than Python's stack: not a call
            return None
    if not isinstance(arguments, dict):
        return None
    return payload["name"], json.dumps(arguments, ensure_ascii=False)


def _marker_prefix_length(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker``."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


class ToolCallParser:
    """Text up to a start marker is content; from the marker on, ``_read`` reads calls.

    A family sets ``start_markers`` and implements ``_read(text, final)``: for the text after a
    marker it returns ``(calls, consumed)``, the calls found at its start and how many characters
    they took; ``([], consumed)`` when those characters are not a call (they go back to content,
    marker included); None when it needs more text (never when ``final``).
    """

    start_markers: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._buffer = ""  # text fed and not yet given out
        self._marker: str | None = None  # the start marker just read past; None between calls
        self._num_calls = 0
        self._blank = ""  # blank text after a call, given out only if more content follows

    def feed(self, text: str) -> ParseStep:
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> ParseStep:
        step = self._drain(final=True)
        self._blank = ""
        return step

    def _drain(self, final: bool) -> ParseStep:
        content: list[str] = []
        calls: list[CallDelta] = []
        while self._buffer or (final and self._marker is not None):
            if self._marker is None:
                start, marker = self._find_start(self._buffer)
                if marker is None:
                    keep = 0 if final else self._hold_back(self._buffer)
                    content.append(self._content(self._buffer[: len(self._buffer) - keep]))
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    break
                content.append(self._content(self._buffer[:start]))
                self._buffer = self._buffer[start + len(marker) :]
                self._marker = marker
                continue
            read = self._read(self._buffer, final)
            if read is None:
                break  # the call is not complete yet
            found, consumed = read
            if not found:
                content.append(self._content(self._marker + self._buffer[:consumed]))
            for name, arguments in found:
                calls.append(CallDelta(self._num_calls, name, arguments))
                self._num_calls += 1
            self._buffer = self._buffer[consumed:]
            self._marker = None
        return ParseStep("".join(content), tuple(calls))

    def _content(self, text: str) -> str:
        """``text`` as content; after a call, blank text waits until something else follows."""
        if self._num_calls == 0:
            return text
        self._blank += text
        if not self._blank.strip():
            return ""
        text, self._blank = self._blank, ""
        return text

    def _find_start(self, text: str) -> tuple[int, str | None]:
        """Where the first start marker is in ``text``, and which; ``(-1, None)`` when none is."""
        found = [(text.find(m), m) for m in self.start_markers if m in text]
        return min(found) if found else (-1, None)

    def _hold_back(self, text: str) -> int:
        """How many characters at the end of ``text`` to keep: they may begin a marker."""
        return max((_marker_prefix_length(text, m) for m in self.start_markers), default=0)

    def _read(self, text: str, final: bool) -> tuple[list[tuple[str, str]], int] | None:
        raise NotImplementedError


class TaggedParser(ToolCallParser):
    """Calls between ``<tool_call>`` and ``</tool_call>``; the last one may lack its end tag."""

    start_markers = ("<tool_call>",)
    end_marker = "</tool_call>"

    def _read(self, text: str, final: bool) -> tuple[list[tuple[str, str]], int] | None:
        end = text.find(self.end_marker)
        if end < 0 and not final:
            return None
        payload, consumed = (text, len(text)) if end < 0 else (text[:end], end + len(self.end_marker))
        try:
            return self._calls(json.loads(payload)), consumed
        except (json.JSONDecodeError, RecursionError):  # nesting deeper than Python's stack: not a call
            return [], consumed

    def _calls(self, payload: Any) -> list[tuple[str, str]]:
        raise NotImplementedError


class HermesParser(TaggedParser):
    """Hermes 2 Pro/3, Qwen2.5 and Qwen3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
    one call per tag."""

    def _calls(self, payload: Any) -> list[tuple[str, str]]:
        call = call_of(payload)
        return [call] if call is not None else []


class SmolLM2Parser(TaggedParser):
    """SmolLM2-Instruct: ``<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>``, a JSON
    list of calls in one tag (a lone object is read as a list of one). One malformed item makes
    the whole tag content."""

    def _calls(self, payload: Any) -> list[tuple[str, str]]:
        calls = [call_of(item) for item in (payload if isinstance(payload, list) else [payload])]
        return [call for call in calls if call is not None] if None not in calls else []


class Llama3JsonParser(ToolCallParser):
    """Llama 3.1/3.2 JSON tool calling: ``{"name": ..., "parameters": {...}}`` objects separated by
    ``;``, after ``<|python_tag|>`` or opening the output. Only an object that opens the output
    (or follows a call) is read as a call: JSON inside prose stays content."""

    start_markers = ("<|python_tag|>",)

    def __init__(self) -> None:
        super().__init__()
        self._seen_content = False

    def _find_start(self, text: str) -> tuple[int, str | None]:
        if not self._seen_content or self._num_calls > 0:
            # The blank (and, after a call, the ';') before an object is its marker: it is
            # dropped with a call and given back with a non-call.
            opening = len(text) - len(text.lstrip(_SEPARATORS if self._num_calls else _BLANK))
            if text[opening:].startswith("{"):
                return 0, text[:opening]
        return super()._find_start(text)

    def _hold_back(self, text: str) -> int:
        if (not self._seen_content or self._num_calls > 0) and not text.strip(_SEPARATORS):
            return len(text)  # nothing but blanks (and ';') yet: an object may follow
        return super()._hold_back(text)

    def _content(self, text: str) -> str:
        self._seen_content = self._seen_content or bool(text)
        if self._num_calls > 0 and not text.strip(_SEPARATORS):
            text = text.replace(";", "")  # a separator after the last call is not content
        return super()._content(text)

    def _read(self, text: str, final: bool) -> tuple[list[tuple[str, str]], int] | None:
        try:
            payload, end = _DECODER.raw_decode(text)
        except (json.JSONDecodeError, RecursionError):  # nesting deeper than Python's stack: not a call
            return ([], len(text)) if final else None
        call = call_of(payload, ("parameters", "arguments"))
        return ([call], end) if call is not None else ([], end)


class NamedCallParser:
    """A named ``tool_choice``: the whole output is the arguments of that one function, streamed
    as they grow (the grammar engine made them match the function's parameters)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._started = False

    def feed(self, text: str) -> ParseStep:
        if not text:
            return ParseStep()
        name = None if self._started else self._name
        self._started = True
        return ParseStep(calls=(CallDelta(0, name, text),))

    def finish(self) -> ParseStep:
        if self._started:
            return ParseStep()
        self._started = True  # no output at all: still the one call, with empty arguments
        return ParseStep(calls=(CallDelta(0, self._name, ""),))


class RequiredCallsParser:
    """``tool_choice="required"``: the output is a JSON array of ``{"name", "parameters"}``
    objects (the grammar engine enforced it); each call is given out once its object is complete.
    What is left unread at the end (an array cut off by max_tokens) is content."""

    def __init__(self) -> None:
        self._text = ""
        self._pos = 0  # where reading goes on; 0 until the '[' is read
        self._given = 0  # the text before this was given out as calls
        self._num_calls = 0
        self._closed = False

    def feed(self, text: str) -> ParseStep:
        self._text += text
        return ParseStep(calls=self._read_calls())

    def finish(self) -> ParseStep:
        calls = self._read_calls()
        rest = "" if self._closed else self._text[self._given :].lstrip(_BLANK + ",")
        return ParseStep(rest, calls)

    def _read_calls(self) -> tuple[CallDelta, ...]:
        calls: list[CallDelta] = []
        while not self._closed:
            pos = len(self._text) - len(self._text[self._pos :].lstrip(_BLANK + ","))
            if pos >= len(self._text):
                break
            if self._pos == 0:
                if self._text[pos] != "[":
                    break  # not an array: all of it is content at the end
                self._pos = pos + 1
                continue
            if self._text[pos] == "]":
                self._closed = True
                break
            try:
                payload, end = _DECODER.raw_decode(self._text, pos)
            except (json.JSONDecodeError, RecursionError):  # nesting deeper than Python's stack: not a call
                break  # not complete yet
            call = call_of(payload, ("parameters", "arguments"))
            if call is None:
                break
            calls.append(CallDelta(self._num_calls, *call))
            self._num_calls += 1
            self._pos = self._given = end
        return tuple(calls)


ReadsToolCalls = ToolCallParser | NamedCallParser | RequiredCallsParser

TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "smollm2": SmolLM2Parser,
}


def make_tool_call_parser(name: str) -> ToolCallParser:
    """A fresh parser of the family ``name`` (one per output). Raises ValueError for an unknown name."""
    try:
        return TOOL_CALL_PARSERS[name]()
    except KeyError:
        choices = ", ".join(sorted(TOOL_CALL_PARSERS))
        raise ValueError(f"unknown tool call parser {name!r} (choices: {choices})") from None

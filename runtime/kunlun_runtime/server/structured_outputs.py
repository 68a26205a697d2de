"""A request body's structured-output fields → the one ``StructuredOutputsParams`` they ask for.

Four spellings reach the same constraint: OpenAI's ``response_format`` (``json_object`` or
``json_schema``), vLLM's ``structured_outputs`` object and vLLM's older ``guided_json``,
``guided_regex``, ``guided_choice`` and ``guided_grammar``. A request may use one of them; two
are a 400 naming both, never a silent choice. ``response_format`` of type ``text`` asks for no
constraint and so conflicts with nothing.

Pure: nothing is compiled here (``serving.prepare_structured_outputs`` does that, off the event
loop). Invariant: the returned params' ``source`` is the exact field path the client sent
(``response_format.json_schema.schema``, ``structured_outputs.regex``, ``guided_choice``, ...),
so every later error, an invalid schema or regex included, names what the client wrote.
"""

from __future__ import annotations

from typing import Any

from kunlun_runtime.errors import InvalidRequestError
from kunlun_runtime.server.protocol import ResponseFormat, SamplingFields, StructuredOutputsField
from kunlun_runtime.structured.params import StructuredOutputsParams

# The wire names of the ``structured_outputs`` object's keys, in the order they are reported.
STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def parse_structured_outputs(body: SamplingFields) -> StructuredOutputsParams | None:
    """The constraint ``body`` asks for, or None when it asks for none.

    Raises:
        InvalidRequestError: two of ``response_format`` (other than ``text``),
            ``structured_outputs`` and the ``guided_*`` fields are given (400, the field names
            them all); a ``json_schema`` response format without its schema; a constraint that
            is empty, has two kinds or is over the size bounds (``StructuredOutputsParams``).
    """
    candidates = [
        params
        for params in (
            _from_response_format(body.response_format),
            _from_structured_outputs(body.structured_outputs),
            _guided("guided_json", json=body.guided_json),
            _guided("guided_regex", regex=body.guided_regex),
            _guided("guided_choice", choice=body.guided_choice),
            _guided("guided_grammar", grammar=body.guided_grammar),
        )
        if params is not None
    ]
    if len(candidates) > 1:
        names = ", ".join(params.source for params in candidates)
        raise InvalidRequestError(
            f"{names}: only one structured output constraint may be given per request (one of "
            "response_format, structured_outputs, guided_json, guided_regex, guided_choice, "
            "guided_grammar)",
            field=names,
        )
    return candidates[0] if candidates else None


def _from_response_format(response_format: ResponseFormat | None) -> StructuredOutputsParams | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True, source="response_format")
    if response_format.json_schema is None:
        raise InvalidRequestError(
            "response_format.json_schema: is required when response_format.type is json_schema",
            field="response_format.json_schema",
        )
    schema = response_format.json_schema.json_schema
    if schema is None:
        raise InvalidRequestError(
            "response_format.json_schema.schema: is required when response_format.type is json_schema",
            field="response_format.json_schema.schema",
        )
    return StructuredOutputsParams(json=schema, source="response_format.json_schema.schema")


def _from_structured_outputs(field: StructuredOutputsField | None) -> StructuredOutputsParams | None:
    """vLLM's object; ``source`` is its one key's path (the object's when it has none or two)."""
    if field is None:
        return None
    json_object = bool(field.json_object)  # false counts as not given (alone: a 400, no constraint)
    given = [
        key
        for key, value in zip(
            STRUCTURED_OUTPUTS_KEYS,
            (field.json_, field.regex, field.choice, field.grammar, json_object or None),
            strict=True,
        )
        if value is not None
    ]
    return StructuredOutputsParams(
        json=field.json_,
        regex=field.regex,
        choice=tuple(field.choice) if field.choice is not None else None,
        grammar=field.grammar,
        json_object=json_object,
        source=f"structured_outputs.{given[0]}" if len(given) == 1 else "structured_outputs",
    )


def _guided(
    name: str,
    *,
    json: str | dict[str, Any] | None = None,
    regex: str | None = None,
    choice: list[str] | None = None,
    grammar: str | None = None,
) -> StructuredOutputsParams | None:
    """The constraint of one ``guided_*`` field, or None when it is left out."""
    if json is None and regex is None and choice is None and grammar is None:
        return None
    return StructuredOutputsParams(
        json=json,
        regex=regex,
        choice=tuple(choice) if choice is not None else None,
        grammar=grammar,
        source=name,
    )

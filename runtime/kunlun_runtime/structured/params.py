"""``StructuredOutputsParams``: what a request's output must match, as vLLM names it.

Exactly one constraint is set: ``json`` (a JSON Schema, as a dict or its JSON text), ``regex``,
``choice`` (one of these strings), ``grammar`` (a Lark grammar) or ``json_object`` (any JSON
object). ``source`` is the request field the constraint came from (``response_format``,
``guided_json``, ``tool_choice``, ...), so every error names what the client sent. Whether a
schema or regex is valid is decided by the grammar engine when it compiles (``grammar``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from kunlun_runtime.errors import InvalidRequestError

ConstraintKind = Literal["json", "json_object", "regex", "choice", "grammar"]

MAX_CONSTRAINT_CHARS = 256 * 1024  # a schema or grammar is compiled on the server: bound its size
MAX_CHOICES = 1024


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    source: str = "structured_outputs"

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice))
        self.validate()

    @property
    def kind(self) -> ConstraintKind:
        if self.json is not None:
            return "json"
        if self.regex is not None:
            return "regex"
        if self.choice is not None:
            return "choice"
        if self.grammar is not None:
            return "grammar"
        return "json_object"

    def validate(self) -> None:
        """Raise InvalidRequestError naming ``source`` unless exactly one bounded constraint is set."""
        given = [
            name
            for name, value in (
                ("json", self.json),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
            )
            if value is not None
        ] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise InvalidRequestError(
                f"{self.source}: exactly one of json, regex, choice, grammar or json_object must be "
                f"given, got {', '.join(given) or 'none'}",
                field=self.source,
            )
        text = self.key() if isinstance(self.json, dict) else self.json or self.regex or self.grammar or ""
        if len(text) > MAX_CONSTRAINT_CHARS:
            raise InvalidRequestError(
                f"{self.source}: the constraint has {len(text)} characters, at most "
                f"{MAX_CONSTRAINT_CHARS} are accepted",
                field=self.source,
            )
        if self.choice is not None:
            if not 1 <= len(self.choice) <= MAX_CHOICES:
                raise InvalidRequestError(
                    f"{self.source}: choice must list 1 to {MAX_CHOICES} strings, got {len(self.choice)}",
                    field=self.source,
                )
            if not all(isinstance(c, str) and c for c in self.choice):
                raise InvalidRequestError(
                    f"{self.source}: choice must list non-empty strings", field=self.source
                )
            if sum(len(c) for c in self.choice) > MAX_CONSTRAINT_CHARS:
                raise InvalidRequestError(
                    f"{self.source}: the choices have more than {MAX_CONSTRAINT_CHARS} characters",
                    field=self.source,
                )

    def key(self) -> str:
        """A canonical text of the constraint: equal constraints share one compiled grammar."""
        value: Any
        if self.json is not None:
            value = _canonical_json(self.json)
        elif self.choice is not None:
            value = list(self.choice)
        else:
            value = self.regex if self.regex is not None else self.grammar
        return json.dumps([self.kind, value])


def _canonical_json(schema: str | dict[str, Any]) -> str:
    """One text per schema however it is spaced, with its keys in their order: the grammar writes
    an object's properties in the schema's order, so two orders are two constraints. Invalid JSON
    stays as sent (compiling it fails anyway)."""
    if isinstance(schema, str):
        try:
            return json.dumps(json.loads(schema))
        except (ValueError, RecursionError):
            return schema
    return json.dumps(schema)

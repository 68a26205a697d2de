"""Request bodies → the one StructuredOutputsParams they ask for: every spelling, every 400.

Bodies are parsed from wire JSON (``model_validate``), as the server parses them, so aliases such
as ``schema`` and ``json`` are exercised too. The last tests check where ``add_prepared`` compiles
a constraint (the tokenizer pool, once per group) against a fake grammar engine.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from kunlun_runtime.errors import InvalidRequestError
from kunlun_runtime.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from kunlun_runtime.server.request_building import add_prepared, children, sampling_params
from kunlun_runtime.server.request_stream import EngineRequest
from kunlun_runtime.server.served_model import ServedModel
from kunlun_runtime.server.structured_outputs import parse_structured_outputs
from kunlun_runtime.structured.params import StructuredOutputsParams

SERVED = ServedModel(engine=None, name="m", max_model_len=64, vocab_size=100, root="/models/m")  # type: ignore[arg-type]
USER = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def make_chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **fields})


def make_completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "x", **fields})


def refusal(body: SamplingFields) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        parse_structured_outputs(body)
    assert caught.value.status_code == 400
    return caught.value


@pytest.mark.parametrize("make", [make_chat, make_completion], ids=["chat", "completion"])
def test_a_body_without_structured_fields_asks_for_nothing(make) -> None:
    assert parse_structured_outputs(make()) is None


def test_response_format_text_asks_for_nothing() -> None:
    assert parse_structured_outputs(make_chat(response_format={"type": "text"})) is None


def test_response_format_json_object_asks_for_any_json_object() -> None:
    params = parse_structured_outputs(make_chat(response_format={"type": "json_object"}))
    assert params == StructuredOutputsParams(json_object=True, source="response_format")


def test_response_format_json_schema_asks_for_its_schema_read_from_the_wire_name() -> None:
    body = make_chat(
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "r", "schema": SCHEMA, "strict": True},
        }
    )
    assert parse_structured_outputs(body) == StructuredOutputsParams(
        json=SCHEMA, source="response_format.json_schema.schema"
    )


def test_a_json_schema_response_format_without_its_schema_is_refused_naming_the_schema() -> None:
    error = refusal(make_chat(response_format={"type": "json_schema", "json_schema": {"name": "r"}}))
    assert error.field == "response_format.json_schema.schema"
    assert error.message.startswith("response_format.json_schema.schema: is required")


def test_a_json_schema_response_format_without_json_schema_is_refused_naming_it() -> None:
    error = refusal(make_chat(response_format={"type": "json_schema"}))
    assert error.field == "response_format.json_schema"


@pytest.mark.parametrize(
    ("wire", "expected"),
    [
        ({"json": SCHEMA}, StructuredOutputsParams(json=SCHEMA, source="structured_outputs.json")),
        ({"json": '{"type": "string"}'},
         StructuredOutputsParams(json='{"type": "string"}', source="structured_outputs.json")),
        ({"regex": r"\d{3}"}, StructuredOutputsParams(regex=r"\d{3}", source="structured_outputs.regex")),
        ({"choice": ["yes", "no"]},
         StructuredOutputsParams(choice=("yes", "no"), source="structured_outputs.choice")),
        ({"grammar": 'start: "a"+'},
         StructuredOutputsParams(grammar='start: "a"+', source="structured_outputs.grammar")),
        ({"json_object": True},
         StructuredOutputsParams(json_object=True, source="structured_outputs.json_object")),
        ({"regex": "a", "json_object": False},
         StructuredOutputsParams(regex="a", source="structured_outputs.regex")),
    ],
    ids=["json-dict", "json-text", "regex", "choice", "grammar", "json_object", "json_object-false"],
)  # fmt: skip
def test_structured_outputs_keys_map_to_their_constraint_with_the_key_as_source(wire, expected) -> None:
    assert parse_structured_outputs(make_completion(structured_outputs=wire)) == expected


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("guided_json", SCHEMA, StructuredOutputsParams(json=SCHEMA, source="guided_json")),
        ("guided_json", '{"type": "object"}',
         StructuredOutputsParams(json='{"type": "object"}', source="guided_json")),
        ("guided_regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}",
         StructuredOutputsParams(regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}", source="guided_regex")),
        ("guided_choice", ["red", "green"],
         StructuredOutputsParams(choice=("red", "green"), source="guided_choice")),
        ("guided_grammar", 'start: "x"', StructuredOutputsParams(grammar='start: "x"', source="guided_grammar")),
    ],
    ids=["json-dict", "json-text", "regex", "choice", "grammar"],
)  # fmt: skip
@pytest.mark.parametrize("make", [make_chat, make_completion], ids=["chat", "completion"])
def test_each_guided_field_maps_to_its_constraint_with_its_name_as_source(
    make, field, value, expected
) -> None:
    assert parse_structured_outputs(make(**{field: value})) == expected


@pytest.mark.parametrize(
    ("fields", "names"),
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format, guided_regex"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}},
          "structured_outputs": {"regex": "a"}},
         "response_format.json_schema.schema, structured_outputs.regex"),
        ({"structured_outputs": {"choice": ["a"]}, "guided_choice": ["b"]},
         "structured_outputs.choice, guided_choice"),
        ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_json, guided_regex"),
        ({"guided_choice": ["a"], "guided_grammar": 'start: "a"'}, "guided_choice, guided_grammar"),
        ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA, "guided_regex": "a"},
         "response_format, guided_json, guided_regex"),
    ],
    ids=["format+regex", "schema+structured", "structured+choice", "json+regex", "choice+grammar", "three"],
)  # fmt: skip
def test_two_constraints_are_refused_naming_every_field_given(fields, names) -> None:
    error = refusal(make_chat(**fields))
    assert error.field == names
    assert error.message.startswith(f"{names}: only one structured output constraint")


def test_a_text_response_format_conflicts_with_nothing() -> None:
    body = make_chat(response_format={"type": "text"}, guided_regex="a+")
    assert parse_structured_outputs(body) == StructuredOutputsParams(regex="a+", source="guided_regex")


def test_two_keys_in_structured_outputs_are_refused_naming_the_object() -> None:
    error = refusal(make_completion(structured_outputs={"regex": "a", "choice": ["a"]}))
    assert error.field == "structured_outputs"
    assert "got regex, choice" in error.message


@pytest.mark.parametrize(
    "wire", [{}, {"json_object": False}, {"unknown": 1}], ids=["empty", "json_object-false", "unknown-key"]
)
def test_a_structured_outputs_object_without_a_constraint_is_refused(wire) -> None:
    error = refusal(make_completion(structured_outputs=wire))
    assert error.field == "structured_outputs"
    assert "got none" in error.message


def test_an_empty_guided_choice_is_refused_naming_it() -> None:
    error = refusal(make_chat(guided_choice=[]))
    assert error.field == "guided_choice"


def test_a_schema_over_the_size_bound_is_refused_naming_the_schema_path() -> None:
    huge = {"type": "object", "description": "x" * (256 * 1024)}
    body = make_chat(response_format={"type": "json_schema", "json_schema": {"schema": huge}})
    assert refusal(body).field == "response_format.json_schema.schema"


def test_sampling_params_carry_the_constraint_to_every_child_request() -> None:
    body = make_chat(n=3, guided_choice=["a", "b"])
    params = sampling_params(body, SERVED, max_tokens=4, logprobs=None)
    expected = StructuredOutputsParams(choice=("a", "b"), source="guided_choice")
    assert params.structured_outputs == expected
    assert [r.params.structured_outputs for r in children("id", [1], params, body)] == [expected] * 3


def test_sampling_params_without_structured_fields_have_no_constraint() -> None:
    body = make_completion()
    assert sampling_params(body, SERVED, max_tokens=4, logprobs=None).structured_outputs is None


def test_sampling_params_refuse_two_constraints_before_any_work() -> None:
    body = make_completion(guided_regex="a", guided_choice=["a"])
    with pytest.raises(InvalidRequestError) as caught:
        sampling_params(body, SERVED, max_tokens=4, logprobs=None)
    assert caught.value.field == "guided_regex, guided_choice"


class FakeCompiler:
    """The grammar engine's ``compile``: records which thread compiled what; refuses ``bad``."""

    def __init__(self) -> None:
        self.compiled: list[tuple[str, str]] = []  # (thread name, constraint key)

    def compile(self, params: StructuredOutputsParams) -> None:
        self.compiled.append((threading.current_thread().name, params.key()))
        if params.regex == "bad":
            raise InvalidRequestError(f"{params.source}: invalid regex", field=params.source)


class FakeAsyncEngine:
    """What ``add_prepared`` uses of AsyncEngine: queue places, ``add`` and ``compile_structured``
    (which the real one hands to the LLMEngine's grammar engine)."""

    def __init__(self) -> None:
        self.compiler = FakeCompiler()
        self.reserved = 0
        self.added: list[EngineRequest] = []

    def compile_structured(self, params: StructuredOutputsParams) -> None:
        self.compiler.compile(params)

    def reserve(self, count: int, tenant: str | None) -> None:
        self.reserved += count

    def release(self, count: int, tenant: str | None) -> None:
        self.reserved -= count

    async def add(self, requests: list[EngineRequest], *, reserved: bool = False) -> str:
        assert reserved
        self.added.extend(requests)
        return "stream"


@pytest.fixture
def served() -> Iterator[ServedModel]:
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
    yield ServedModel(
        engine=FakeAsyncEngine(),
        name="m",
        max_model_len=64,
        vocab_size=100,
        root="m",
        tokenizer_pool=pool,  # type: ignore[arg-type]
    )
    pool.shutdown()


def make_group(body: SamplingFields) -> list[EngineRequest]:
    return children("id", [1, 2], sampling_params(body, SERVED, max_tokens=4, logprobs=None), body)


async def test_add_prepared_compiles_a_groups_constraint_once_on_the_tokenizer_pool(served) -> None:
    group = make_group(make_chat(n=3, guided_regex="a+"))

    async def prepare() -> list[EngineRequest]:
        return group

    assert await add_prepared(served, 3, None, prepare) == "stream"
    compiler = served.engine.compiler
    assert compiler.compiled == [("tokenizer_0", StructuredOutputsParams(regex="a+").key())]
    assert served.engine.added == group and served.engine.reserved == 3


async def test_add_prepared_compiles_nothing_for_a_free_request(served) -> None:
    async def prepare() -> list[EngineRequest]:
        return make_group(make_chat())

    await add_prepared(served, 1, None, prepare)
    assert served.engine.compiler.compiled == []


async def test_a_constraint_that_fails_to_compile_gives_back_the_places_and_queues_nothing(served) -> None:
    async def prepare() -> list[EngineRequest]:
        return make_group(make_chat(n=2, structured_outputs={"regex": "bad"}))

    with pytest.raises(InvalidRequestError) as caught:
        await add_prepared(served, 2, None, prepare)
    assert caught.value.field == "structured_outputs.regex"
    assert served.engine.reserved == 0 and served.engine.added == []

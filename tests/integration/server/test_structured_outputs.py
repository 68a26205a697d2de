"""Structured outputs through the official ``openai`` SDK against a live server on the embedded model.

The model is the real SmolLM2-135M-Instruct, so every constrained reply is checked the way a
client would check it: ``json.loads`` and ``jsonschema.validate`` against the schema that was sent,
``re.fullmatch`` against the regex, membership in the choices. Most requests go out as one
concurrent batch (the ``batch`` fixture), so every kind of constraint, a stream, a completion
group and free requests share the engine's steps and its grammar masks, and the module stays
within a few engine runs on two cores; all are greedy (temperature 0), so free requests can be
compared exactly with the same requests sent alone. The examples of the "Structured outputs"
section of docs/server.md are run here too, as written.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import jsonschema
import openai
import pytest

from kunlun_runtime.models.default_model import resolve_default_model
from tests.integration.server.live import LiveServer, sample, scrape, serve_in_thread

MODEL = "SmolLM2-135M-Instruct"  # served under the embedded model's name, as the docs call it
KV_CACHE_MEMORY_BYTES = 256 << 20  # 20 concurrent requests of ~150 tokens in float32, with room
MAX_MODEL_LEN = 1024
MAX_TOKENS = 96  # every schema below completes well within this
DOCS = Path(__file__).resolve().parents[3] / "docs" / "server.md"
T = TypeVar("T")


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    model_dir = resolve_default_model(progress=False)
    with serve_in_thread(
        model_dir,
        max_queue_len=64,
        kv_cache_memory_bytes=KV_CACHE_MEMORY_BYTES,
        max_model_len=MAX_MODEL_LEN,
        served_model_name=MODEL,
    ) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="EMPTY", max_retries=0, timeout=300)


def in_parallel(calls: list[Callable[[], T]]) -> list[T]:
    """Every call at once, each on its own thread; results in the order of ``calls``."""
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        return [future.result() for future in [pool.submit(call) for call in calls]]


def chat(client: openai.OpenAI, content: str, max_tokens: int = MAX_TOKENS, **options: Any):
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0,
        **options,
    )


def json_schema_format(schema: dict[str, Any], name: str = "reply") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


# -- schemas: every property required, no others, strings and arrays bounded, so a greedy small
# -- model always completes them within MAX_TOKENS
def obj(**properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def text(max_length: int = 12) -> dict[str, Any]:
    return {"type": "string", "minLength": 1, "maxLength": max_length, "pattern": "^[A-Za-z ]+$"}


def integer(minimum: int, maximum: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


def number(minimum: float, maximum: float) -> dict[str, Any]:
    # multipleOf bounds the digits (a greedy small model may write 312.1234567...0 forever); 0.5
    # is exact in binary, so jsonschema's own multipleOf check has no rounding to trip on
    return {"type": "number", "minimum": minimum, "maximum": maximum, "multipleOf": 0.5}


def enum(*values: str) -> dict[str, Any]:
    return {"type": "string", "enum": list(values)}


def array(items: dict[str, Any], max_items: int = 3) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": 1, "maxItems": max_items}


BOOLEAN = {"type": "boolean"}
SCHEMA_CASES: list[tuple[str, dict[str, Any]]] = [
    ("Describe a cat as JSON.", obj(name=text(), age=integer(0, 30), indoor=BOOLEAN)),
    ("Give the weather in Paris as JSON.",
     obj(celsius=number(-50, 60), sky=enum("sunny", "cloudy", "rainy", "snowy"))),
    ("Describe a book as JSON.",
     obj(title=text(), year=integer(1000, 2100), genres=array(enum("fiction", "science", "history"), 2))),
    ("Describe a person and where they live as JSON.",
     obj(name=text(8), address=obj(city=text(8), zip={"type": "string", "pattern": "^[0-9]{5}$"}))),
    ("List the primary colors as JSON.", obj(colors=array(enum("red", "green", "blue", "yellow")))),
    ("Rate a movie as JSON.", obj(stars=integer(1, 5), recommended=BOOLEAN)),
    ("Describe a car as JSON.", obj(make=text(10), electric=BOOLEAN)),
    ("What is 6 times 7? Answer as JSON.", obj(answer=integer(0, 1000))),
    ("Report a server's health as JSON.", obj(up=BOOLEAN, load_percent=number(0, 100))),
    ("Describe a recipe as JSON.", obj(dish=text(), servings=integer(1, 12), vegetarian=BOOLEAN)),
    ("Describe a planet as JSON.",
     obj(planet=enum("Mercury", "Venus", "Earth", "Mars", "Jupiter"), moons=integer(0, 100))),
    ("Describe a shop order as JSON.",
     obj(order_id=integer(1, 999), quantities=array(integer(1, 9)), paid=BOOLEAN)),
    ("What color is the traffic light? Answer as JSON.", obj(state=enum("red", "yellow", "green"))),
    ("Describe a user account as JSON.",
     obj(user=obj(name=text(8), role=enum("admin", "editor", "viewer")), active=BOOLEAN)),
    ("Give a point on a plane as JSON.", obj(x=integer(-100, 100), y=integer(-100, 100))),
    ("Describe a song as JSON.", obj(title=text(), seconds=integer(30, 600))),
    ("Describe a country as JSON.", obj(country=text(10), population_millions=number(0, 2000))),
    ("Summarize a test run as JSON.", obj(passed=integer(0, 100), failed=integer(0, 100), green=BOOLEAN)),
    ("Describe a dog and its tricks as JSON.",
     obj(name=text(8), tricks=array(obj(trick=enum("sit", "roll", "fetch")), 2))),
    ("Describe a flight as JSON.",
     obj(flight={"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}, delayed=BOOLEAN,
         gate=obj(terminal=integer(1, 5), number=integer(1, 60)))),
]  # fmt: skip


FREE_PROMPTS = ["Tell me about the sea.", "Name a famous painter."]
FREE_MAX_TOKENS = 8
DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
PHONE = r"\+1-[0-9]{3}-[0-9]{3}-[0-9]{4}"
REGEX_CASES = {
    "date": ("When did the first moon landing happen?", DATE),
    "phone": ("Give me a phone number.", PHONE),
}
MOODS = ["positive", "negative", "neutral"]
PET = obj(animal=enum("cat", "dog", "bird"), legs=integer(0, 8))
PERSON = obj(name=text(10), age=integer(0, 120), tags=array(enum("kind", "tall", "quiet"), 2))


def free_chat(client: openai.OpenAI, prompt: str):
    return chat(client, prompt, max_tokens=FREE_MAX_TOKENS, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def batch(client) -> dict[str, Any]:
    """The replies to one batch, sent all at once so that JSON schemas, regexes, a choice, a JSON
    object, a stream, a completion group and free requests share the engine's steps: {name: reply}
    (a stream's reply is its list of chunks)."""
    calls: dict[str, Callable[[], Any]] = {
        f"schema-{i}": lambda prompt=prompt, schema=schema: chat(
            client, prompt, response_format=json_schema_format(schema)
        )
        for i, (prompt, schema) in enumerate(SCHEMA_CASES)
    }
    calls |= {
        f"free-{i}": lambda prompt=prompt: free_chat(client, prompt) for i, prompt in enumerate(FREE_PROMPTS)
    }
    calls |= {
        name: lambda prompt=prompt, pattern=pattern: chat(
            client, prompt, extra_body={"guided_regex": pattern}
        )
        for name, (prompt, pattern) in REGEX_CASES.items()
    }
    calls["choice"] = lambda: chat(
        client, "Is 'I love this song!' positive or negative?", extra_body={"guided_choice": MOODS}
    )
    calls["json_object"] = lambda: chat(
        client, 'Reply with a JSON object whose key "name" is "Ada".', response_format={"type": "json_object"}
    )
    calls["stream"] = lambda: list(
        chat(client, "Describe a person as JSON.", response_format=json_schema_format(PERSON), stream=True)
    )
    calls["completions"] = lambda: client.completions.create(
        model=MODEL,
        prompt=["A pet, as JSON:", "An animal with wings, as JSON:"],
        max_tokens=MAX_TOKENS,
        temperature=0,
        n=2,
        extra_body={"structured_outputs": {"json": PET}},
    )
    return dict(zip(calls, in_parallel(list(calls.values())), strict=True))


def test_twenty_concurrent_json_schemas_each_yield_a_valid_instance(batch) -> None:
    assert len({json.dumps(schema, sort_keys=True) for _, schema in SCHEMA_CASES}) == 20
    for i, (prompt, schema) in enumerate(SCHEMA_CASES):
        [choice] = batch[f"schema-{i}"].choices
        assert choice.finish_reason == "stop", (prompt, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_yields_a_json_object(batch) -> None:
    [choice] = batch["json_object"].choices
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(json.loads(choice.message.content), dict)


@pytest.mark.parametrize("name", list(REGEX_CASES))
def test_guided_regex_yields_a_full_match(batch, name) -> None:
    [choice] = batch[name].choices
    assert choice.finish_reason == "stop"
    assert re.fullmatch(REGEX_CASES[name][1], choice.message.content), choice.message.content


def test_guided_choice_yields_one_of_the_choices(batch) -> None:
    [choice] = batch["choice"].choices
    assert choice.finish_reason == "stop"
    assert choice.message.content in MOODS


def test_completions_honour_structured_outputs_for_every_prompt_and_choice(batch) -> None:
    reply = batch["completions"]
    assert [choice.index for choice in reply.choices] == [0, 1, 2, 3]
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), PET)


def test_a_streamed_reply_with_a_schema_concatenates_to_a_valid_instance(batch) -> None:
    chunks = [chunk for chunk in batch["stream"] if chunk.choices]
    content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert len(chunks) > 3  # the role, several deltas, the finish reason
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(content), PERSON)


def test_free_requests_get_the_same_text_alone_and_beside_constrained_ones(client, batch) -> None:
    beside = [batch[f"free-{i}"] for i in range(len(FREE_PROMPTS))]
    alone = [free_chat(client, prompt) for prompt in FREE_PROMPTS]  # one at a time: batches of one
    assert [r.choices[0].message.content for r in beside] == [r.choices[0].message.content for r in alone]
    assert all(r.usage.completion_tokens == FREE_MAX_TOKENS for r in [*beside, *alone])


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"response_format": json_schema_format({"type": "nonsense"})}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "r"}}},
         "response_format.json_schema.schema"),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
        ({"extra_body": {"structured_outputs": {"grammar": "start: undefined_rule"}}}, "structured_outputs.grammar"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"guided_choice": ["a", "b"]}},
         "response_format, guided_choice"),
        ({"extra_body": {"guided_regex": "a+", "guided_json": {"type": "object"}}}, "guided_json, guided_regex"),
    ],
    ids=["invalid-schema", "missing-schema", "invalid-regex", "invalid-grammar", "format+choice", "json+regex"],
)  # fmt: skip
def test_an_invalid_or_doubled_constraint_is_a_400_naming_the_field(client, options, field) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, "Hi.", **options)
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == field  # the SDK's body is the "error" object
    assert caught.value.body["message"].startswith(f"{field}: ")


def test_suffix_is_refused_as_vllm_refuses_it(client) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="def f(", suffix="return x", max_tokens=4)
    assert caught.value.body["message"] == "suffix is not currently supported"
    assert caught.value.body["param"] == "suffix"


def test_a_schema_cut_short_by_max_tokens_ends_with_length_and_the_server_serves_on(client) -> None:
    schema = obj(first=text(), second=text(), third=text(), fourth=text())
    reply = chat(
        client, "Describe four things as JSON.", max_tokens=5, response_format=json_schema_format(schema)
    )
    [choice] = reply.choices
    assert choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 5
    assert choice.message.content.startswith('{"first')  # a prefix of the only form allowed
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice.message.content)
    after = chat(client, "Say hello.", max_tokens=3)
    assert after.choices[0].finish_reason in ("stop", "length") and after.choices[0].message.content


def prefix_cache_hits(server: LiveServer) -> float:
    return sample(scrape(server.base_url), "vllm:prefix_cache_hits_total", model_name=MODEL)


def test_a_repeated_constrained_prompt_hits_the_prefix_cache(client, server) -> None:
    schema = obj(answer=integer(0, 100))
    prompt = "In a new cache namespace, a question long enough to fill whole blocks: what is 7 plus 8?"

    def ask():
        return chat(
            client, prompt, response_format=json_schema_format(schema), extra_body={"cache_salt": "so"}
        )

    before = prefix_cache_hits(server)
    first = ask()
    after_first = prefix_cache_hits(server)
    second = ask()
    after_second = prefix_cache_hits(server)
    assert after_first == before  # a salt nobody used before: nothing to hit
    assert after_second - after_first >= 16  # at least one whole block of the prompt
    assert second.choices[0].message.content == first.choices[0].message.content
    jsonschema.validate(json.loads(second.choices[0].message.content), schema)


def docs_section_blocks(language: str) -> list[str]:
    """The ``language`` code blocks of docs/server.md's "Structured outputs" section."""
    section = DOCS.read_text().split("\n## Structured outputs\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.DOTALL)


def pointed_at(example: str, server: LiveServer) -> str:
    assert "http://localhost:8000" in example
    return example.replace("http://localhost:8000", server.base_url)


def test_the_docs_curl_example_returns_a_valid_instance(server) -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    [example] = docs_section_blocks("bash")
    result = subprocess.run(
        ["bash", "-c", pointed_at(example, server)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    body = json.loads(result.stdout)
    assert body["choices"][0]["finish_reason"] == "stop"
    assert isinstance(json.loads(body["choices"][0]["message"]["content"]), dict)


def test_the_docs_openai_sdk_example_runs(server) -> None:
    [example] = docs_section_blocks("python")
    result = subprocess.run(
        [sys.executable, "-c", pointed_at(example, server)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()

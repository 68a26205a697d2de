"""Request limits: what a single request may ask of the server is bounded before the work starts.

A prompt over ``--max-prompt-chars``, a lone surrogate, too many or too long stop strings or stop
token ids, a ``max_tokens`` beyond the context, and a group that can never fit in the queue are all
400s naming the field; and a prompt that takes long to tokenize delays neither /health nor other
requests (its tokenizer is made to block on an event, standing in for a huge prompt).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kunlun_runtime.engine.llm_engine import LLMEngine
from kunlun_runtime.engine.sampling_params import (
    MAX_NUM_STOP_STRINGS,
    MAX_NUM_STOP_TOKEN_IDS,
    MAX_STOP_STRING_CHARS,
)
from kunlun_runtime.models.tokenizer import Tokenizer
from kunlun_runtime.server.served_model import DEFAULT_MAX_PROMPT_CHARS, INLINE_TOKENIZE_MAX_CHARS
from tests.integration.server.live import LiveServer, health_status, serve_in_thread
from tests.support.waiting import wait_for

SLOW_MARKER = "tokenize-me-slowly"
# Long enough to be tokenized on the pool (shorter prompts are tokenized inline), and so longer
# than the tiny model's context: the slow request ends in a 400 once its tokens are counted.
LARGE_PROMPT = SLOW_MARKER + " the" * INLINE_TOKENIZE_MAX_CHARS


def post(server: LiveServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, headers=server.headers, timeout=60)


def assert_bad_request(response: httpx.Response, param: str, text: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("BadRequestError", param, 400)
    assert text in error["message"]


def test_a_prompt_over_the_character_limit_is_refused_naming_the_field(live_server: LiveServer) -> None:
    huge = "a" * (DEFAULT_MAX_PROMPT_CHARS + 1)
    completion = post(live_server, "/v1/completions", {"prompt": huge, "max_tokens": 1})
    assert_bad_request(completion, "prompt", f"more than this server accepts ({DEFAULT_MAX_PROMPT_CHARS}")
    split = post(
        live_server, "/v1/completions", {"prompt": [huge[:600_000], huge[600_000:]], "max_tokens": 1}
    )
    assert_bad_request(split, "prompt", "--max-prompt-chars")
    chat = post(live_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]})
    assert_bad_request(chat, "messages", "--max-prompt-chars")
    tokenize = post(live_server, "/tokenize", {"prompt": huge})
    assert_bad_request(tokenize, "prompt", "--max-prompt-chars")
    tokenize_chat = post(live_server, "/tokenize", {"messages": [{"role": "user", "content": huge}]})
    assert_bad_request(tokenize_chat, "messages", "--max-prompt-chars")


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 1}', "prompt"),
        ("/v1/completions", '{"prompt": ["ok", "\\udfff"], "max_tokens": 1}', "prompt"),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "\\ud800"}]}',
            "messages.0.content",
        ),
        ("/v1/completions", '{"prompt": "ok", "stop": ["\\ud800"], "max_tokens": 1}', "stop"),
    ],
)
def test_a_lone_surrogate_is_a_bad_request_naming_the_field(
    live_server: LiveServer, path: str, body: str, param: str
) -> None:
    headers = {**live_server.headers, "Content-Type": "application/json"}
    response = httpx.post(f"{live_server.base_url}{path}", content=body, headers=headers, timeout=60)
    assert_bad_request(response, param, "must be valid Unicode text")


@pytest.mark.parametrize(
    ("extra", "param", "text"),
    [
        ({"stop": [f"s{i}" for i in range(100_000)]}, "stop", f"at most {MAX_NUM_STOP_STRINGS} stop strings"),
        ({"stop": "x" * (MAX_STOP_STRING_CHARS + 1)}, "stop", f"at most {MAX_STOP_STRING_CHARS} characters"),
        (
            {"stop_token_ids": [1] * (MAX_NUM_STOP_TOKEN_IDS + 1)},
            "stop_token_ids",
            "stop token ids are allowed",
        ),
    ],
)
def test_stop_conditions_are_bounded(live_server: LiveServer, extra: dict, param: str, text: str) -> None:
    for path, body in (
        ("/v1/completions", {"prompt": "the", "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    ):
        assert_bad_request(post(live_server, path, {**body, **extra}), param, text)
    within = {"stop": ["x" * MAX_STOP_STRING_CHARS] * MAX_NUM_STOP_STRINGS, "stop_token_ids": [1]}
    assert (
        post(live_server, "/v1/completions", {"prompt": "the", "max_tokens": 2, **within}).status_code == 200
    )


def test_max_tokens_beyond_the_context_is_a_bad_request_not_cut_short(live_server: LiveServer) -> None:
    """vLLM's answer; before, the request silently finished early with finish_reason "length"."""
    num_prompt = len(post(live_server, "/tokenize", {"prompt": "the cat"}).json()["tokens"])
    max_model_len = post(live_server, "/tokenize", {"prompt": "x"}).json()["max_model_len"]
    room = max_model_len - num_prompt
    too_many = post(live_server, "/v1/completions", {"prompt": "the cat", "max_tokens": room + 1})
    assert_bad_request(
        too_many,
        "max_tokens",
        f"maximum context length is {max_model_len} tokens and the request has {num_prompt} input tokens "
        f"({room + 1} > {max_model_len} - {num_prompt})",
    )
    chat = post(
        live_server,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": max_model_len},
    )
    assert_bad_request(chat, "max_tokens", "is too large")
    never_enough = post(live_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                             "min_tokens": max_model_len})  # fmt: skip
    assert_bad_request(never_enough, "min_tokens", "is too large")
    fits = post(live_server, "/v1/completions", {"prompt": "the cat", "max_tokens": room, "ignore_eos": True})
    assert fits.status_code == 200
    assert fits.json()["usage"]["completion_tokens"] == room


def test_a_group_larger_than_the_queue_is_a_bad_request_not_retry_later(tiny_model_dir: Path) -> None:
    with serve_in_thread(tiny_model_dir, max_queue_len=2) as server:
        response = post(server, "/v1/completions", {"prompt": "the", "n": 3, "max_tokens": 1})
        assert_bad_request(response, "n", "more than it ever has (2, --max-queue-len)")
        assert post(server, "/v1/completions", {"prompt": "the", "n": 2, "max_tokens": 1}).status_code == 200


# -- tokenization stays off the event loop and off the engine thread ---------------------------------


class GatedTokenizer:
    """A tokenizer whose ``encode`` blocks on ``gate`` for texts holding ``SLOW_MARKER``."""

    gate = threading.Event()
    entered = threading.Event()

    def __init__(self, inner: Tokenizer) -> None:
        self._inner = inner

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if SLOW_MARKER in text:
            self.entered.set()
            self.gate.wait(120)
        return self._inner.encode(text, add_special_tokens=add_special_tokens)

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


class SlowTokenizingEngine(LLMEngine):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.tokenizer = GatedTokenizer(self.tokenizer)  # type: ignore[assignment]


@pytest.fixture
def slow_tokenizing_server(tiny_model_dir: Path) -> Iterator[LiveServer]:
    GatedTokenizer.gate.clear()
    GatedTokenizer.entered.clear()
    try:
        with serve_in_thread(tiny_model_dir, engine_class=SlowTokenizingEngine) as server:
            yield server
    finally:
        GatedTokenizer.gate.set()


@pytest.mark.parametrize(
    ("path", "slow_body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": LARGE_PROMPT}], "max_tokens": 2}),
        ("/v1/completions", {"prompt": LARGE_PROMPT, "max_tokens": 2}),
    ],
)
def test_health_and_other_requests_are_served_while_a_prompt_is_tokenized(
    slow_tokenizing_server: LiveServer, path: str, slow_body: dict
) -> None:
    server = slow_tokenizing_server
    answers: list[httpx.Response] = []
    slow = threading.Thread(target=lambda: answers.append(post(server, path, slow_body)))
    slow.start()
    try:
        wait_for(
            GatedTokenizer.entered.is_set, timeout_seconds=60.0, message="the slow tokenization to start"
        )
        wait_for(lambda: health_status(server.base_url) == 200, timeout_seconds=5.0, message="/health")
        other = post(server, "/v1/completions", {"prompt": "the", "max_tokens": 2})
        assert other.status_code == 200 and other.json()["usage"]["completion_tokens"] >= 1
        assert slow.is_alive(), "the slow request should still be tokenizing"
    finally:
        GatedTokenizer.gate.set()
        slow.join(60)
    assert [a.status_code for a in answers] == [400]
    assert "maximum context length" in json.loads(answers[0].text)["error"]["message"]

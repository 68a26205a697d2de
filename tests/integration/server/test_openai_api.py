"""The official ``openai`` client against a live server: chat, completions, n, stop, seed, logprobs.

Every expectation is checked against something independent of the HTTP path where one exists:
usage counts against the model's own tokenizer, streamed text against the non-streamed text of
the same seed, n > 1 choices against single requests seeded ``seed + i`` (the offline API's rule).
"""

from __future__ import annotations

import httpx
import openai
import pytest

from kunlun_runtime.models.tokenizer import Tokenizer
from tests.integration.server.live import LiveServer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key=live_server.api_key, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(live_server: LiveServer) -> Tokenizer:
    return Tokenizer(live_server.model_dir)


def chat(client: openai.OpenAI, live_server: LiveServer, **kwargs):
    options = {"model": live_server.model_name, "messages": MESSAGES, "max_tokens": 8, **kwargs}
    return client.chat.completions.create(**options)


def test_chat_completion_returns_the_requested_tokens_and_exact_usage(client, live_server, tokenizer) -> None:
    response = chat(client, live_server, max_tokens=6, temperature=0.0, extra_body=NO_EOS)
    assert response.object == "chat.completion"
    assert response.model == live_server.model_name
    [choice] = response.choices
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(tokenizer.encode_chat(MESSAGES))
    assert response.usage.completion_tokens == 6
    assert response.usage.total_tokens == response.usage.prompt_tokens + 6


def test_max_completion_tokens_takes_precedence_over_max_tokens(client, live_server) -> None:
    response = chat(client, live_server, max_tokens=9, max_completion_tokens=3, extra_body=NO_EOS)
    assert response.usage.completion_tokens == 3


def test_completions_accept_strings_lists_and_token_ids_with_exact_usage(
    client, live_server, tokenizer
) -> None:
    prompts = ["the cat", "in the hat"]
    response = client.completions.create(
        model=live_server.model_name, prompt=prompts, max_tokens=4, temperature=0.0, extra_body=NO_EOS
    )
    assert [c.index for c in response.choices] == [0, 1]
    assert response.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert response.usage.completion_tokens == 8
    by_ids = client.completions.create(
        model=live_server.model_name, prompt=tokenizer.encode("the cat"), max_tokens=4, temperature=0.0,
        extra_body=NO_EOS,
    )  # fmt: skip
    assert by_ids.choices[0].text == response.choices[0].text


def test_echo_prepends_the_prompt(client, live_server) -> None:
    plain = client.completions.create(
        model=live_server.model_name, prompt="the", max_tokens=3, temperature=0.0
    )
    echoed = client.completions.create(
        model=live_server.model_name, prompt="the", max_tokens=3, temperature=0.0, echo=True
    )
    assert echoed.choices[0].text == "the" + plain.choices[0].text


def test_streamed_echo_completion_equals_the_non_streamed_one(client, live_server) -> None:
    options = {"model": live_server.model_name, "prompt": "the", "max_tokens": 6, "seed": 9, "echo": True}
    whole = client.completions.create(**options)
    chunks = list(client.completions.create(**options, stream=True))
    assert whole.choices[0].text.startswith("the")
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


def test_streamed_chat_logprobs_cover_every_token(client, live_server) -> None:
    chunks = list(chat(client, live_server, max_tokens=7, logprobs=True, top_logprobs=1, stream=True,
                       stream_options={"include_usage": True}, extra_body=NO_EOS))  # fmt: skip
    entries = [
        e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert len(entries) == chunks[-1].usage.completion_tokens == 7


def test_streamed_chat_concatenates_to_the_non_streamed_text_for_the_same_seed(client, live_server) -> None:
    whole = chat(client, live_server, max_tokens=24, seed=11, temperature=1.0)
    stream = chat(client, live_server, max_tokens=24, seed=11, temperature=1.0, stream=True,
                  stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_streamed_completion_concatenates_to_the_non_streamed_text(client, live_server) -> None:
    options = {"model": live_server.model_name, "prompt": "in the", "max_tokens": 20, "seed": 5}
    whole = client.completions.create(**options)
    chunks = list(client.completions.create(**options, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_n_choices_equal_single_requests_seeded_seed_plus_index(client, live_server) -> None:
    response = chat(client, live_server, n=3, seed=100, max_tokens=10)
    assert [c.index for c in response.choices] == [0, 1, 2]
    singles = [
        chat(client, live_server, seed=100 + i, max_tokens=10).choices[0].message.content for i in range(3)
    ]
    assert [c.message.content for c in response.choices] == singles
    assert response.usage.completion_tokens == sum(
        chat(client, live_server, seed=100 + i, max_tokens=10).usage.completion_tokens for i in range(3)
    )


def test_streamed_n_choices_match_the_non_streamed_ones(client, live_server) -> None:
    whole = chat(client, live_server, n=2, seed=3, max_tokens=12)
    texts = {0: "", 1: ""}
    for chunk in chat(client, live_server, n=2, seed=3, max_tokens=12, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]


def test_same_seed_reproduces_and_other_seeds_differ(client, live_server) -> None:
    first = chat(client, live_server, seed=42, max_tokens=12, extra_body=NO_EOS).choices[0].message.content
    again = chat(client, live_server, seed=42, max_tokens=12, extra_body=NO_EOS).choices[0].message.content
    others = {chat(client, live_server, seed=s, max_tokens=12, extra_body=NO_EOS).choices[0].message.content
              for s in (1, 2, 3)}  # fmt: skip
    assert first == again
    assert others - {first}


def test_stop_string_cuts_the_text_before_it(client, live_server) -> None:
    full = (
        chat(client, live_server, temperature=0.0, max_tokens=40, extra_body=NO_EOS)
        .choices[0]
        .message.content
    )
    position = next(
        i for i, ch in enumerate(full) if i > 0 and ch.isascii() and ch.isprintable() and ch != " "
    )
    stop = full[position]
    stopped = chat(client, live_server, temperature=0.0, max_tokens=40, stop=[stop], extra_body=NO_EOS)
    assert stopped.choices[0].message.content == full[: full.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def test_chat_logprobs_list_every_token_with_sorted_alternatives(client, live_server) -> None:
    response = chat(client, live_server, temperature=0.0, logprobs=True, top_logprobs=3, extra_body=NO_EOS)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for item in content:
        tops = [t.logprob for t in item.top_logprobs]
        assert len(tops) == 3
        assert tops == sorted(tops, reverse=True)
        assert item.logprob == pytest.approx(tops[0])  # greedy: the chosen token is the most likely


def test_completion_logprobs_use_the_legacy_shape(client, live_server) -> None:
    response = client.completions.create(
        model=live_server.model_name,
        prompt="the",
        max_tokens=5,
        temperature=0.0,
        logprobs=2,
        extra_body=NO_EOS,
    )
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    for chosen, tops in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert chosen == pytest.approx(max(tops.values()))


def test_unknown_model_is_not_found(client) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert caught.value.body["param"] == "model"


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", -1.0), ("top_p", 0.0), ("n", 0), ("max_tokens", 0), ("top_logprobs", 99), ("top_k", -5)],
)
def test_invalid_field_is_a_bad_request_naming_the_field(client, live_server, field, value) -> None:
    extra = {"logprobs": True} if field == "top_logprobs" else {}
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, live_server, extra_body={field: value, **extra})
    assert caught.value.body["param"] == field
    assert caught.value.body["type"] == "BadRequestError"


def test_prompt_beyond_max_model_len_is_a_bad_request_stating_both_lengths(client, live_server) -> None:
    too_long = [65] * 600
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=live_server.model_name, prompt=too_long, max_tokens=1)
    message = caught.value.body["message"]
    assert "512" in message and "600" in message
    assert caught.value.body["param"] == "prompt"


def test_wrong_api_key_is_unauthorized(live_server) -> None:
    bad = openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_models_tokenize_detokenize_version_and_health(client, live_server, tokenizer) -> None:
    assert [m.id for m in client.models.list().data] == [live_server.model_name]
    base, headers = live_server.base_url, live_server.headers
    tokens = httpx.post(f"{base}/tokenize", json={"prompt": "the hat"}, headers=headers).json()
    assert tokens["tokens"] == tokenizer.encode("the hat") and tokens["count"] == len(tokens["tokens"])
    text = httpx.post(f"{base}/detokenize", json={"tokens": tokens["tokens"]}, headers=headers).json()
    assert text == {"prompt": "the hat"}
    assert httpx.get(f"{base}/version").json()["version"]
    assert httpx.get(f"{base}/health").status_code == 200

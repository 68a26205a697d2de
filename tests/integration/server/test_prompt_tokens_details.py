"""``usage.prompt_tokens_details.cached_tokens`` (vLLM's ``--enable-prompt-tokens-details``): the
prompt tokens a request was served from the prefix cache, on chat and completions, streamed or not,
read through the real ``openai`` client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.integration.server.live import LiveServer, serve_in_thread

BLOCK_SIZE = 16  # the engine's default KV block: only whole blocks are cached
PROMPT = "the quick brown fox jumps over the lazy dog " * 6  # several full blocks


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[LiveServer]:
    with serve_in_thread(tiny_model_dir, app_options={"enable_prompt_tokens_details": True}) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="EMPTY", max_retries=0, timeout=120)


def completion_usage(client: openai.OpenAI, model: str, prompt: str, *, stream: bool):
    if not stream:
        return client.completions.create(model=model, prompt=prompt, max_tokens=2).usage
    chunks = client.completions.create(
        model=model, prompt=prompt, max_tokens=2, stream=True, stream_options={"include_usage": True}
    )
    return [chunk.usage for chunk in chunks if chunk.usage is not None][-1]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_repeated_completion_prompt_reports_its_cached_blocks(
    client: openai.OpenAI, server: LiveServer, stream: bool
) -> None:
    prompt = f"{'streamed' if stream else 'whole'} {PROMPT}"
    first = completion_usage(client, server.model_name, prompt, stream=stream)
    again = completion_usage(client, server.model_name, prompt, stream=stream)
    assert first.prompt_tokens_details.cached_tokens == 0
    cached = again.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.prompt_tokens == first.prompt_tokens  # the last token is always computed
    assert cached % BLOCK_SIZE == 0
    assert cached >= first.prompt_tokens - BLOCK_SIZE  # every full block but the last one's tail


def test_a_repeated_chat_reports_its_cached_blocks(client: openai.OpenAI, server: LiveServer) -> None:
    messages = [{"role": "user", "content": f"chat {PROMPT}"}]
    first = client.chat.completions.create(model=server.model_name, messages=messages, max_tokens=2)
    chunks = client.chat.completions.create(
        model=server.model_name,
        messages=messages,
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    streamed = [chunk.usage for chunk in chunks if chunk.usage is not None][-1]
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert streamed.prompt_tokens == first.usage.prompt_tokens
    assert 0 < streamed.prompt_tokens_details.cached_tokens < streamed.prompt_tokens


def test_without_the_flag_usage_has_no_details(tiny_model_dir: Path) -> None:
    with serve_in_thread(tiny_model_dir) as live:
        plain = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="EMPTY", max_retries=0, timeout=120)
        for _ in range(2):
            usage = plain.completions.create(model=live.model_name, prompt=PROMPT, max_tokens=2).usage
            assert usage.prompt_tokens_details is None

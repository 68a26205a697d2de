"""``ServedModel``: the model the routes serve, its limits, and its tokenizer off the event loop.

What the routes know of the engine comes from ``AsyncEngine`` (its ``facts`` and ``tokenizer``),
never from the engine itself. Prompts are rendered (chat template) and tokenized here, never on the
engine thread, and a long one (``INLINE_TOKENIZE_MAX_CHARS`` on) on a small thread pool, not on the
event loop: the engine gets token ids, and a huge prompt delays neither /health nor other requests'
steps. A prompt's size is checked first (``max_prompt_chars``), so the work is bounded before it
starts. The same pool compiles structured-output constraints (``request_building``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kunlun_runtime.errors import InvalidRequestError
from kunlun_runtime.lora.request import LoRARequest
from kunlun_runtime.models.tokenizer import Tokenizer
from kunlun_runtime.server.adapters import ServedAdapters
from kunlun_runtime.server.async_engine import AsyncEngine

DEFAULT_MAX_PROMPT_CHARS = 1_000_000
NUM_TOKENIZER_THREADS = 2  # tokenization is CPU work: more threads would only take cores from steps
# Shorter prompts are tokenized inline: well under a millisecond, less than the hop to a thread.
INLINE_TOKENIZE_MAX_CHARS = 4096


@dataclass(slots=True)
class ServedModel:
    """The engine being served, and what the routes need to know about it."""

    engine: AsyncEngine
    name: str
    max_model_len: int
    vocab_size: int
    root: str
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS  # longer prompts are refused before any work
    tokenizer_pool: concurrent.futures.ThreadPoolExecutor | None = None  # None: asyncio's default
    tool_call_parser: str | None = None  # --tool-call-parser: how tool calls are read from output
    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice: tool_choice "auto" is served
    enable_prompt_tokens_details: bool = False  # --enable-prompt-tokens-details: usage counts cached tokens
    # The LoRA adapters requests may name; omitted: none (built for ``name`` in __post_init__).
    adapters: ServedAdapters = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.adapters is None:
            self.adapters = ServedAdapters(self.name)

    @classmethod
    def of(
        cls, async_engine: AsyncEngine, *, max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS
    ) -> ServedModel:
        facts = async_engine.facts
        return cls(
            engine=async_engine,
            name=facts.served_model_name,
            max_model_len=facts.max_model_len,
            vocab_size=facts.vocab_size,
            root=str(facts.model_dir),
            max_prompt_chars=max_prompt_chars,
            tokenizer_pool=concurrent.futures.ThreadPoolExecutor(
                NUM_TOKENIZER_THREADS, thread_name_prefix="tokenizer"
            ),
            adapters=ServedAdapters(facts.served_model_name, enabled=facts.enable_lora),
        )

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model). Raises APIError 404
        for a name that is neither the base model's nor a served adapter's."""
        return self.adapters.resolve(model)

    def check_prompt_chars(self, num_chars: int, field: str) -> None:
        """Raise InvalidRequestError naming ``field`` when a prompt has too many characters."""
        if num_chars > self.max_prompt_chars:
            raise InvalidRequestError(
                f"{field}: {num_chars} characters, more than this server accepts "
                f"({self.max_prompt_chars}, --max-prompt-chars)",
                field=field,
            )

    async def encode(self, text: str, *, field: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids, computed on the tokenizer pool; its length is checked first."""
        self.check_prompt_chars(len(text), field)
        return await self._tokenize(
            len(text), lambda: self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        )

    async def encode_chat(
        self, conversation: list[dict[str, Any]], add_generation_prompt: bool, **kwargs: Any
    ) -> list[int]:
        """The token ids of the rendered chat template, computed on the tokenizer pool; the
        conversation's length is checked first. Raises InvalidRequestError naming ``messages``."""
        num_chars = sum(len(str(m.get("content") or "")) for m in conversation)
        self.check_prompt_chars(num_chars, "messages")

        def render_and_encode() -> list[int]:
            text = self.tokenizer.render_chat(conversation, add_generation_prompt, **kwargs)
            return self.tokenizer.encode(text, add_special_tokens=False)

        return await self._tokenize(num_chars, render_and_encode)

    async def _tokenize(self, num_chars: int, work: Callable[[], list[int]]) -> list[int]:
        """``work()`` inline for a short prompt, else on the tokenizer pool."""
        if num_chars < INLINE_TOKENIZE_MAX_CHARS:
            return work()
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, work)

    def close(self) -> None:
        if self.tokenizer_pool is not None:
            self.tokenizer_pool.shutdown(wait=False, cancel_futures=True)


def token_text(served: ServedModel, token_id: int) -> str:
    """One token decoded on its own, special tokens kept (how logprobs name their tokens)."""
    return served.tokenizer.decode([token_id], skip_special_tokens=False)

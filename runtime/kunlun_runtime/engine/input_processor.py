"""The engine's door: a prompt and its sampling parameters in, a ``Request`` that can be served in
full out (in the spirit of vLLM v1's input processor).

Owns tokenising the prompt (text, a list of token ids, or vLLM's ``{"prompt": ...}`` and
``{"prompt_token_ids": ...}`` dicts) and the checks that need the model: every id in the
vocabulary, a prompt that leaves at least one token to generate, ``max_tokens`` and ``min_tokens``
within the context. It refuses with an InvalidRequestError naming the field, rather than cutting
a request short; it queues nothing (the engine does).

Invariant: a request that passes fits the KV cache, which holds at least one sequence of
``max_model_len`` tokens (``plan_num_blocks``).
"""

from __future__ import annotations

import time
from typing import Any

from kunlun_runtime.engine.request import Request
from kunlun_runtime.engine.sampling_params import SamplingParams
from kunlun_runtime.errors import InvalidRequestError
from kunlun_runtime.models.tokenizer import Tokenizer

PromptInput = str | list[int] | dict[str, Any]  # what ``LLMEngine.add_request`` takes as a prompt


class InputProcessor:
    """Turns what a caller asks for into a ``Request`` of one engine's model and context."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._max_model_len = max_model_len

    def make_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> tuple[str | None, Request]:
        """The prompt's text (None when it came as token ids) and the request to queue.

        Raises InvalidRequestError naming ``prompt``, ``max_tokens`` or ``min_tokens``.
        """
        prompt_text, token_ids = self.tokenize(prompt)
        self.check_prompt(token_ids)
        self.check_lengths(len(token_ids), params)
        limit = self._max_model_len
        if params.max_tokens is not None:
            limit = len(token_ids) + params.max_tokens
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            params=params,
            max_total_tokens=limit,
            arrival_time=arrival_time or time.monotonic(),
            priority=priority,
            cache_salt=cache_salt,
        )
        return prompt_text, request

    def tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """The prompt's text (None for token ids) and its token ids; raises InvalidRequestError
        naming ``prompt`` for anything but a string, a list of ints or one of vLLM's dicts."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            prompt = prompt.get("prompt", "")
        if isinstance(prompt, str):
            return prompt, self._tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise InvalidRequestError("prompt: must be a string or a list of token ids", field="prompt")

    def check_prompt(self, token_ids: list[int]) -> None:
        """Refuse an empty prompt, ids outside the vocabulary, and a prompt that fills the context."""
        if not token_ids:
            raise InvalidRequestError("prompt: must not be empty", field="prompt")
        bad = [t for t in token_ids if not 0 <= t < self._vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt: token ids out of range: {bad[:5]}", field="prompt")
        if len(token_ids) >= self._max_model_len:
            raise InvalidRequestError(
                f"prompt: this model's maximum context length is {self._max_model_len} tokens, but the "
                f"prompt has {len(token_ids)} tokens (at least one token must be left to generate)",
                field="prompt",
            )

    def check_lengths(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Refuse what can never be served in full instead of cutting it short: a ``max_tokens``
        beyond the context (as vLLM answers) and a ``min_tokens`` beyond it."""
        room = self._max_model_len - num_prompt_tokens
        for name, value in (("max_tokens", params.max_tokens), ("min_tokens", params.min_tokens)):
            if value is not None and value > room:
                raise InvalidRequestError(
                    f"{name}: {value} is too large: this model's maximum context length is "
                    f"{self._max_model_len} tokens and the request has {num_prompt_tokens} input tokens "
                    f"({value} > {self._max_model_len} - {num_prompt_tokens})",
                    field=name,
                )

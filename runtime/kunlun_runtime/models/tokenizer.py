"""Tokenizer and chat template of a HF-format model directory.

Loads ``tokenizer.json`` with the ``tokenizers`` library and the chat template from
``tokenizer_config.json`` (or ``chat_template.jinja``), rendered with a sandboxed jinja2
environment the way HF's ``apply_chat_template`` renders it, then tokenized without extra
special tokens. Incremental detokenization lives in ``engine.detokenizer``. A long text is encoded through
the library's batch call, which releases the GIL, so encoding it on a worker thread does not stall
the server's event loop (the single-text call holds the GIL throughout). ``renders_tools`` says
whether the template uses the ``tools`` variable at all: the server writes tools into the prompt
itself for a template that does not.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError, meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as RustTokenizer

from kunlun_runtime.errors import InvalidRequestError, ModelLoadError

# From this many characters on, encode through ``encode_batch`` (it releases the GIL; the same ids).
GIL_FREE_ENCODE_MIN_CHARS = 4096


def _raise(message: str) -> None:
    raise TemplateError(message)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


# The chat template variables the caller of ``render_chat`` sets itself (the messages, the
# generation prompt, the special tokens, the tools): user-given template variables may not.
RESERVED_TEMPLATE_VARIABLES = frozenset(
    {"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"}
)


class Tokenizer:
    def __init__(self, model_dir: Path) -> None:
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise ModelLoadError(f"{path}: missing (the model directory needs a tokenizer.json)")
        try:
            self._tok = RustTokenizer.from_file(str(path))
        except Exception as error:  # the tokenizers library raises plain Exception subclasses
            raise ModelLoadError(f"{path}: cannot load tokenizer ({error})") from error
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        template = config.get("chat_template")
        jinja_path = model_dir / "chat_template.jinja"
        if template is None and jinja_path.exists():
            template = jinja_path.read_text()
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.special_token_ids = frozenset(
            token_id for token_id, added in self._tok.get_added_tokens_decoder().items() if added.special
        )
        self._env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._env.globals["raise_exception"] = _raise
        self._env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._compiled = self._env.from_string(template) if template else None
        # Whether the template reads ``tools`` (HF's apply_chat_template variable), e.g. Qwen2.5's
        # and Llama 3.1's do and SmolLM2's does not.
        self.renders_tools = isinstance(template, str) and "tools" in meta.find_undeclared_variables(
            self._env.parse(template)
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) >= GIL_FREE_ENCODE_MIN_CHARS:
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text for ``messages``; ``tools`` (``[{"type": "function", "function": {...}}]``,
        as HF passes them) reach the template as its ``tools`` variable. Raises
        InvalidRequestError for a template error."""
        if self._compiled is None:
            raise InvalidRequestError("messages: this model has no chat template", field="messages")
        if tools is not None:
            extra["tools"] = tools
        try:
            return self._compiled.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **extra,
            )
        except TemplateError as error:
            raise InvalidRequestError(f"messages: chat template failed: {error}", field="messages") from error

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)

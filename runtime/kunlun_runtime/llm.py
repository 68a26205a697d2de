"""The offline API, vLLM-compatible in shape: ``LLM(...).generate(prompts, params)`` and ``chat``.

``n > 1`` is served as n engine requests sharing the prompt (the prefix cache shares its blocks);
their outputs are merged into one ``RequestOutput`` per prompt, in prompt order.

Logprobs leave in vLLM's shape (``kunlun_runtime.engine.logprobs``): the outputs this API returns, and
those ``on_output`` sees, carry ``token_id -> Logprob`` dicts where the engine's carry
``TokenLogprob`` records (which the server reads). Each position is converted once per call.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any, cast

from kunlun_runtime.config import EngineConfig, parse_kv_events_config, parse_memory, parse_speculative_config
from kunlun_runtime.engine.llm_engine import LLMEngine
from kunlun_runtime.engine.logprobs import (
    PromptLogprobs,
    SampleLogprobs,
    build_prompt_logprobs,
    build_sample_logprobs,
)
from kunlun_runtime.engine.outputs import RequestOutput
from kunlun_runtime.engine.sampling_params import SamplingParams
from kunlun_runtime.lora.request import LoRARequest
from kunlun_runtime.models.tokenizer import RESERVED_TEMPLATE_VARIABLES, Tokenizer

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # typing.TypeIs from Python 3.13

_CONFIG_FIELDS = {f.name for f in fields(EngineConfig)}


class LLM:
    def __init__(self, model: str | None = None, **options: Any) -> None:
        """``options`` are EngineConfig fields (``dtype``, ``block_size``, ``max_model_len``, ...);
        ``kv_cache_memory`` accepts a size string such as ``"2GiB"``, ``kv_events_config`` vLLM's
        KVEventsConfig keys as a dict or JSON (as vLLM's ``LLM(kv_events_config=...)``), and
        ``speculative_config`` vLLM's speculative keys likewise."""
        if "kv_cache_memory" in options:
            options["kv_cache_memory_bytes"] = parse_memory(options.pop("kv_cache_memory"))
        if "kv_events_config" in options:
            options["kv_events_config"] = parse_kv_events_config(options["kv_events_config"])
        if "speculative_config" in options:
            options["speculative_config"] = parse_speculative_config(options["speculative_config"])
        unknown = set(options) - _CONFIG_FIELDS
        if unknown:
            raise TypeError(f"LLM() got unknown options: {sorted(unknown)}")
        self.engine = LLMEngine(EngineConfig(model=model, **options))
        self._ids = itertools.count()

    def close(self) -> None:
        """Close the engine: its last KV events sent, the publisher's sockets and the other ranks
        (tensor or pipeline parallel) closed. ``with LLM(...) as llm:`` closes it on leaving."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An LLM over an already built EngineConfig (the CLI's path)."""
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(config)
        llm._ids = itertools.count()
        return llm

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | dict | Sequence[str | dict | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; one RequestOutput per prompt, in order. ``lora_request``:
        the LoRA adapter of every prompt, or one per prompt (None: the base model), as vLLM's."""
        # Anything but a list or tuple is one prompt, of whatever type: the engine validates it
        # (InvalidRequestError naming the field), so the elements are Any here.
        prompt_list: Sequence[Any] = prompts if isinstance(prompts, (list, tuple)) else [prompts]
        params_list = self._per_prompt(sampling_params, len(prompt_list))
        loras = _per_prompt_lora(lora_request, len(prompt_list))
        shape = _VllmLogprobs(self.engine.tokenizer)
        groups: list[list[str]] = []
        try:
            for index, (prompt, params) in enumerate(zip(prompt_list, params_list, strict=True)):
                base = f"offline-{next(self._ids)}"
                ids: list[str] = []
                groups.append(ids)  # before adding: a later failure must abort what was added
                for child in range(params.n):
                    child_params = replace(params, n=1)
                    if params.seed is not None:
                        child_params.seed = params.seed + child
                    request_id = f"{base}-{child}"
                    self.engine.add_request(
                        request_id,
                        prompt,
                        child_params,
                        priority=priority[index] if priority else 0,
                        lora_request=loras[index],
                    )
                    ids.append(request_id)
            finished = self._run(on_output, shape)
        except BaseException:
            for ids in groups:
                for request_id in ids:
                    self.engine.abort_request(request_id)
            raise
        return [self._merge([finished[i] for i in ids]) for ids in groups]

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate.

        ``tools`` (OpenAI's ``[{"type": "function", "function": {...}}]``) and
        ``chat_template_kwargs`` reach the template as its variables, as in vLLM. A template that
        does not use ``tools`` would silently drop them: that is a ValueError instead (the server's
        ``--tool-call-parser`` writes tools into the prompt for such models).
        """
        tokenizer = self.engine.tokenizer
        if tools is not None and not tokenizer.renders_tools:
            raise ValueError(
                "tools: this model's chat template does not use tools; serve it with "
                "--tool-call-parser, which writes them into the system prompt"
            )
        conversations = [messages] if _is_one_conversation(messages) else list(messages)
        reserved = sorted(RESERVED_TEMPLATE_VARIABLES & set(chat_template_kwargs or {}))
        if reserved:
            raise ValueError(f"chat_template_kwargs: {', '.join(reserved)} are set by chat() itself")
        variables = dict(chat_template_kwargs or {})
        if tools is not None:
            variables["tools"] = tools
        prompts = [
            {
                "prompt_token_ids": tokenizer.encode(
                    tokenizer.render_chat(c, add_generation_prompt, **variables), add_special_tokens=False
                )
            }
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, **kwargs)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, as vLLM's ``LLM.reset_prefix_cache``: True when done (it is
        refused, False, while a request holds blocks); KV events then say ``AllBlocksCleared``."""
        return self.engine.reset_prefix_cache()

    def _per_prompt(self, params, count: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams() for _ in range(count)]
        if isinstance(params, SamplingParams):
            return [params] * count
        if len(params) != count:
            raise ValueError(f"sampling_params: {len(params)} given for {count} prompts")
        return list(params)

    def _run(
        self, on_output: Callable[[RequestOutput], None] | None, shape: _VllmLogprobs
    ) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if on_output is None and not output.finished:
                    continue
                output = shape.convert(output)
                if on_output is not None:
                    on_output(output)
                if output.finished:
                    finished[output.request_id] = output
        return finished

    @staticmethod
    def _merge(children: list[RequestOutput]) -> RequestOutput:
        first = children[0]
        outputs = []
        for index, child in enumerate(children):
            outputs.append(replace(child.outputs[0], index=index))
        return replace(first, request_id=first.request_id.rsplit("-", 1)[0], outputs=outputs)


class _VllmLogprobs:
    """Converts the engine's logprobs of one ``generate`` call into vLLM's shape.

    The engine's lists only grow while a request runs, so each request keeps the positions
    converted so far and a later output of it converts only the new ones; each token id is
    decoded once.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        # vLLM decodes a logprob's token on its own with the tokenizer's default: specials kept.
        self._decode = functools.cache(
            lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)
        )
        self._sample: dict[str, SampleLogprobs] = {}
        self._prompt: dict[str, PromptLogprobs] = {}

    def convert(self, output: RequestOutput) -> RequestOutput:
        """``output`` with its (and its completion's) logprobs in vLLM's shape; None stays None."""
        completion = output.outputs[0]
        sample: SampleLogprobs | None = None
        if completion.logprobs is not None:
            done = self._sample.setdefault(output.request_id, [])
            done.extend(build_sample_logprobs(completion.logprobs[len(done) :], self._decode))
            sample = list(done)
        prompt: PromptLogprobs | None = None
        if output.prompt_logprobs is not None:
            done_prompt = self._prompt.setdefault(output.request_id, [])
            done_prompt.extend(
                build_prompt_logprobs(output.prompt_logprobs[len(done_prompt) :], self._decode)
            )
            prompt = list(done_prompt)
        # RequestOutput's annotations name the engine's records; the offline outputs carry vLLM's.
        completion = replace(completion, logprobs=cast(Any, sample))
        return replace(output, outputs=[completion], prompt_logprobs=cast(Any, prompt))


def _is_one_conversation(
    messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
) -> TypeIs[list[dict[str, Any]]]:
    """True for one conversation (its messages), False for a list of conversations."""
    return bool(messages) and isinstance(messages[0], dict)


def _per_prompt_lora(
    lora: LoRARequest | Sequence[LoRARequest | None] | None, count: int
) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * count
    if len(lora) != count:
        raise ValueError(f"lora_request: {len(lora)} given for {count} prompts")
    return list(lora)

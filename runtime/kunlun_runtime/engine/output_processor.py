"""Each new token into an output: detokenise it, check the stop conditions, assemble the
``RequestOutput`` (in the spirit of vLLM v1's ``OutputProcessor``).

Owns each request's output state (``RequestState``): its incremental detokenizer, the text
released so far, its timestamps and its finish reason. It decides when a request ends (its
grammar, an EOS, a stop token, a stop string, its length) and what the output says; it never
frees anything: the engine finishes the request in the scheduler and the sampler, then asks here
for the final output.

Invariant: a running request's text never ends in what could still become the start of a stop
string, nor in half a character; a stop string is cut from the final text (kept only with
``include_stop_str_in_output``).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from kunlun_runtime.engine.detokenizer import IncrementalDetokenizer
from kunlun_runtime.engine.outputs import CompletionOutput, RequestOutput, RequestTimes
from kunlun_runtime.engine.request import Request, RequestStatus
from kunlun_runtime.models.tokenizer import Tokenizer
from kunlun_runtime.structured.grammar import GrammarMatcher


@dataclass(slots=True)
class RequestState:
    """What the engine keeps of one request between its steps, beside the request itself."""

    request: Request
    prompt: str | None  # the prompt text as given; None when it came as token ids
    detokenizer: IncrementalDetokenizer
    times: RequestTimes
    text: str = ""  # the text released so far (what the next output says)
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while running
    grammar: GrammarMatcher | None = None  # the request's place in its structured-output grammar
    grammar_end: RequestStatus | None = None  # set when the last token completed or broke the grammar


class OutputProcessor:
    """Detokenises, checks stops and builds outputs for the requests of one engine."""

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: Collection[int]) -> None:
        self._tokenizer = tokenizer
        self._eos_token_ids = eos_token_ids

    def new_state(
        self, request: Request, prompt: str | None, grammar: GrammarMatcher | None = None
    ) -> RequestState:
        """The output state of a request just admitted (its detokenizer primed with the prompt)."""
        detokenizer = IncrementalDetokenizer(
            self._tokenizer, request.prompt_token_ids, request.params.skip_special_tokens
        )
        return RequestState(request, prompt, detokenizer, RequestTimes(request.arrival_time), grammar=grammar)

    def process_token(self, state: RequestState, token_id: int) -> RequestStatus | None:
        """Detokenise ``token_id``, already appended to the request's output, and check the stop
        conditions: the status that ends the request now, or None while it goes on. Updates the
        state's text, and the request's ``stop_reason`` when a stop token or string ends it."""
        state.detokenizer.add(token_id)
        return self._check_stop(state, token_id)

    def _check_stop(self, state: RequestState, token_id: int) -> RequestStatus | None:
        request, params = state.request, state.request.params
        num_out = len(request.output_token_ids)
        if state.grammar_end is not None:
            return state.grammar_end
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token_id in self._eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
            text = state.detokenizer.text
            for stop in params.stop:
                # Only where the new text could hold it: from what was released, less a stop's length.
                index = text.find(stop, max(0, len(state.text) - len(stop)))
                if index != -1:
                    request.stop_reason = stop
                    state.text = text[: index + (len(stop) if params.include_stop_str_in_output else 0)]
                    return RequestStatus.FINISHED_STOPPED
        if request.num_tokens >= request.max_total_tokens:
            return RequestStatus.FINISHED_LENGTH
        # Hold back what could still become the start of a stop string.
        hold = max((len(s) - 1 for s in params.stop), default=0)
        text = state.detokenizer.text
        state.text = text[: max(0, len(text) - hold)]
        return None

    def finish(
        self, state: RequestState, status: RequestStatus, new_token_ids: Sequence[int] = ()
    ) -> RequestOutput:
        """The final output of a request that ends with ``status``: whatever text was held back is
        released (all of it, even half a character), unless a stop string already cut it."""
        if not isinstance(state.request.stop_reason, str):
            state.detokenizer.flush()
            state.text = state.detokenizer.text
        state.finish_reason = status.value
        state.times.finished = time.monotonic()
        return self.make_output(state, list(new_token_ids))

    def make_output(self, state: RequestState, new_token_ids: list[int]) -> RequestOutput:
        """The output of ``state`` as it stands; ``new_token_ids``: those generated this step."""
        request = state.request
        logprobs = list(request.output_logprobs) if request.params.logprobs is not None else None
        completion = CompletionOutput(
            index=0,
            text=state.text,
            token_ids=list(request.output_token_ids),
            finish_reason=state.finish_reason,
            stop_reason=request.stop_reason,
            logprobs=logprobs,
            cumulative_logprob=sum(lp.logprob for lp in logprobs) if logprobs else None,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=state.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=state.finish_reason is not None,
            prompt_logprobs=list(request.prompt_logprobs) if request.wants_prompt_logprobs else None,
            num_cached_tokens=request.num_cached_prompt_tokens,
            times=state.times,
            new_token_ids=new_token_ids,
            max_tokens=request.max_total_tokens - len(request.prompt_token_ids),
        )

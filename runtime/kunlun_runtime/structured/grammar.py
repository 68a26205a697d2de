"""Compiling constraints into grammars and tracking each request's place in its grammar.

The grammar engine is llguidance: it needs nothing but its own wheel (no torch build of its own,
no triton, no compiler at run time), so the same code runs on every CPU and in the Kunlun image;
it takes JSON Schema, regex and Lark grammars, and computes a request's allowed tokens on demand
from the grammar's current state without precomputing a table over the vocabulary, which keeps
compiling a schema in the milliseconds. docs/performance.md compares it with xgrammar and
outlines-core.

``GrammarCompiler`` is shared by the server's threads (which compile while they prepare a request,
off the engine thread) and the engine thread (which compiles again on a cache hit and starts the
request's matcher). A compiled grammar is kept as a matcher in its initial state; each request
gets a copy of it.

JSON is generated with Python's separators (``", "`` and ``": "``) and no other whitespace: a
free choice of whitespace lets a small model fill its tokens with newlines and never close the
object, and one canonical form keeps outputs byte-comparable. These options override a schema's
own ``x-guidance`` settings, so a client cannot turn them off.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.numpy  # not llguidance.torch: importing it compiles a kernel with torch.compile
import numpy as np

from kunlun_runtime.errors import InvalidRequestError
from kunlun_runtime.structured.params import ConstraintKind, StructuredOutputsParams

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
DEFAULT_CACHE_SIZE = 256
_MAX_ERROR_CHARS = 600
CONSTRAINT_KINDS: tuple[ConstraintKind, ...] = ("json", "json_object", "regex", "choice", "grammar")


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of ``params``; raises InvalidRequestError for a schema that is not
    JSON."""
    if params.json is not None:
        schema: Any = params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except RecursionError:
                raise InvalidRequestError(
                    f"{params.source}: the JSON schema is nested too deeply", field=params.source
                ) from None
            except ValueError as error:
                raise InvalidRequestError(
                    f"{params.source}: the JSON schema is not valid JSON ({error})", field=params.source
                ) from None
        if not isinstance(schema, dict):
            raise InvalidRequestError(
                f"{params.source}: a JSON schema must be an object, got {type(schema).__name__}",
                field=params.source,
            )
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    if params.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if params.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        # JSON string literals are Lark string literals: any choice text is quoted safely.
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(choice) for choice in params.choice)
        )
    assert params.grammar is not None  # StructuredOutputsParams holds exactly one constraint
    return llguidance.LLMatcher.grammar_from_lark(params.grammar)


class GrammarMatcher:
    """One request's state in its grammar: which tokens may come next, and advancing by one."""

    def __init__(self, matcher: llguidance.LLMatcher, kind: ConstraintKind) -> None:
        self._matcher = matcher
        self.kind = kind

    def accept(self, token_id: int) -> bool:
        """Advance by ``token_id``; False when the grammar does not allow it (the state is then
        an error state)."""
        return bool(self._matcher.consume_token(token_id))

    def validate(self, token_ids: Sequence[int]) -> int:
        """How many of ``token_ids``, in turn, the grammar accepts from its state (the state
        unchanged): speculative decoding's drafts are cut there."""
        return int(self._matcher.validate_tokens(list(token_ids)))

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and allows nothing more (only an end-of-sequence token)."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str | None:
        return str(self._matcher.get_error()) if self._matcher.is_error() else None

    @property
    def llg_matcher(self) -> llguidance.LLMatcher:
        return self._matcher


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` for one tokenizer, caching compiled grammars by their
    constraint (least recently used beyond ``cache_size``); computes allowed-token bitmasks.

    Thread-safe. Counters (read by the metrics): ``requests_total`` per constraint kind,
    ``mask_seconds_total``, ``compile_seconds_total``, ``cache_hits_total``.
    """

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        self.vocab_size = vocab_size
        self._tokenizer_json = tokenizer_json
        self._eos_token_ids = list(eos_token_ids)
        self._cache_size = cache_size
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._vocabulary: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self.requests_total: dict[str, int] = dict.fromkeys(CONSTRAINT_KINDS, 0)
        self.mask_seconds_total = 0.0
        self.compile_seconds_total = 0.0
        self.cache_hits_total = 0

    def _vocabulary_locked(self) -> llguidance.LLTokenizer:
        """The grammar engine's view of the vocabulary: built on first use (it takes a fraction of
        a second), so a server that never sees a constraint never pays for it."""
        if self._vocabulary is None:
            self._vocabulary = llguidance.LLTokenizer(
                self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self._eos_token_ids
            )
            self._executor = llguidance.LLExecutor()
        return self._vocabulary

    def compile(self, params: StructuredOutputsParams) -> None:
        """Compile ``params`` into the cache; raises InvalidRequestError naming ``params.source``
        when the schema, regex or grammar is invalid."""
        self._compiled(params)

    def _compiled(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        key = params.key()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.cache_hits_total += 1
                return cached
            vocabulary = self._vocabulary_locked()
        began = time.perf_counter()
        try:
            text = grammar_text(params)
        except InvalidRequestError:  # already names the field (it is a ValueError too)
            raise
        except ValueError as error:  # llguidance's own conversions raise ValueError
            raise _invalid(params, str(error)) from None
        matcher = llguidance.LLMatcher(vocabulary, text, log_level=0)
        elapsed = time.perf_counter() - began
        if matcher.is_error():
            raise _invalid(params, str(matcher.get_error()))
        with self._lock:
            self.compile_seconds_total += elapsed
            self._cache[key] = matcher
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return matcher

    def new_matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh state of ``params``'s grammar for one request (compiled or taken from the
        cache); counts the request under its constraint kind."""
        matcher = self._compiled(params).deep_copy()
        with self._lock:
            self.requests_total[params.kind] += 1
        return GrammarMatcher(matcher, params.kind)

    def fill_bitmask(
        self, matchers: Sequence[GrammarMatcher], drafts: Sequence[Sequence[int]] | None = None
    ) -> np.ndarray:
        """The allowed next tokens of each matcher, as an int32 bitmask [len(matchers), ⌈V/32⌉]
        (bit ``t % 32`` of word ``t // 32`` set = token ``t`` allowed). Computed by llguidance's
        threads without the GIL, so it can run while the model's forward does.

        ``drafts`` (speculative decoding; one list per matcher, tokens its grammar accepts): matcher
        ``i`` gets ``1 + len(drafts[i])`` consecutive rows, its allowed tokens now and after each of
        its drafts in turn; llguidance advances it through them and rolls it back, so it ends in
        the state it began in."""
        began = time.perf_counter()
        if drafts is not None and any(drafts):
            bitmask = self._fill_with_drafts(matchers, drafts)
            with self._lock:
                self.mask_seconds_total += time.perf_counter() - began
            return bitmask
        bitmask = llguidance.numpy.allocate_token_bitmask(len(matchers), self.vocab_size)
        if len(matchers) == 1:
            llguidance.numpy.fill_next_token_bitmask(matchers[0].llg_matcher, bitmask, 0)
        elif matchers:
            assert self._executor is not None  # a matcher exists, so the vocabulary was built
            llguidance.numpy.fill_next_token_bitmask_par(
                self._executor, [(m.llg_matcher, row) for row, m in enumerate(matchers)], bitmask
            )
        with self._lock:
            self.mask_seconds_total += time.perf_counter() - began
        return bitmask

    def _fill_with_drafts(
        self, matchers: Sequence[GrammarMatcher], drafts: Sequence[Sequence[int]]
    ) -> np.ndarray:
        starts = list(itertools.accumulate((1 + len(d) for d in drafts), initial=0))
        # Zeros, not llguidance's all-allowed: the rows after a draft that stopped the grammar stay
        # unwritten, and allow nothing (the sampler's rule for an empty row then gives EOS).
        shape = llguidance.numpy.get_bitmask_shape(starts[-1], self.vocab_size)
        bitmask = np.zeros(shape, dtype=np.int32)
        assert self._executor is not None  # a matcher exists, so the vocabulary was built
        rows = list(zip(matchers, starts[:-1], drafts, strict=True))
        plain = [(m.llg_matcher, start) for m, start, tokens in rows if not tokens]
        drafted = [(m.llg_matcher, start, list(tokens)) for m, start, tokens in rows if tokens]
        if plain:
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, plain, bitmask)
        llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted, bitmask)
        return bitmask


def _invalid(params: StructuredOutputsParams, detail: str) -> InvalidRequestError:
    detail = " ".join(detail.split())  # one line: the engine's caret diagrams lose their meaning in JSON
    if len(detail) > _MAX_ERROR_CHARS:
        detail = detail[:_MAX_ERROR_CHARS] + " ..."
    return InvalidRequestError(
        f"{params.source}: invalid {params.kind} constraint: {detail}", field=params.source
    )

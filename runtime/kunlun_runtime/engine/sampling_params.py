"""``SamplingParams``: how to pick tokens and when to stop, validated with the field named.

Field names and defaults follow vLLM's SamplingParams, so offline code and the HTTP API's extra
body fields (``top_k``, ``min_p``, ``repetition_penalty``, ...) mean the same thing. Stop strings
and stop token ids are bounded in number and length: every one is checked against every new
token on the engine's single thread, so an unbounded list would slow every request sharing it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kunlun_runtime.errors import InvalidRequestError
from kunlun_runtime.structured.params import StructuredOutputsParams

_MAX_LOGPROBS = 20
MAX_NUM_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
MAX_NUM_STOP_TOKEN_IDS = 128


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None = up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (the sampled one always included)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # The output must match this constraint (JSON Schema, regex, ...): masked before sampling.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self) -> None:
        """Raise InvalidRequestError (HTTP 400) naming the first invalid field."""
        _require(self.n >= 1, "n", f"must be at least 1, got {self.n}")
        _require(self.temperature >= 0, "temperature", f"must be non-negative, got {self.temperature}")
        _require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _require(self.top_k >= 0, "top_k", f"must be -1 (disabled) or at least 1, got {self.top_k}")
        _require(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        _require(
            -2 <= self.presence_penalty <= 2,
            "presence_penalty",
            f"must be in [-2, 2], got {self.presence_penalty}",
        )
        _require(
            -2 <= self.frequency_penalty <= 2,
            "frequency_penalty",
            f"must be in [-2, 2], got {self.frequency_penalty}",
        )
        _require(
            self.repetition_penalty > 0,
            "repetition_penalty",
            f"must be positive, got {self.repetition_penalty}",
        )
        _require(
            self.max_tokens is None or self.max_tokens >= 1,
            "max_tokens",
            f"must be at least 1, got {self.max_tokens}",
        )
        _require(self.min_tokens >= 0, "min_tokens", f"must be non-negative, got {self.min_tokens}")
        _require(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must not exceed max_tokens ({self.min_tokens} > {self.max_tokens})",
        )
        self._validate_stops()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _require(
                value is None or 0 <= value <= _MAX_LOGPROBS,
                name,
                f"must be in [0, {_MAX_LOGPROBS}], got {value}",
            )

    def _validate_stops(self) -> None:
        """Bound the stop conditions: each is checked against every generated token."""
        _require(
            len(self.stop) <= MAX_NUM_STOP_STRINGS,
            "stop",
            f"at most {MAX_NUM_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}",
        )
        _require(
            all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty strings"
        )
        longest = max((len(s) for s in self.stop), default=0)
        _require(
            longest <= MAX_STOP_STRING_CHARS,
            "stop",
            f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters, got {longest}",
        )
        _require(
            len(self.stop_token_ids) <= MAX_NUM_STOP_TOKEN_IDS,
            "stop_token_ids",
            f"at most {MAX_NUM_STOP_TOKEN_IDS} stop token ids are allowed, got {len(self.stop_token_ids)}",
        )
        _require(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be token ids",
        )


def _require(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(f"{field_name}: {message}", field=field_name)

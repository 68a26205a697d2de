"""Parse ``spec.runtime.speculative``: speculative decoding without a second model.

Owns: each field's type and range, which method a field belongs to, and the
checks the CRD's CEL rules also make (a field of the other method refused; ``promptLookupMin`` at
most ``promptLookupMax``, or the runtime's default maximum when that is unset), so a spec the API
server would refuse is refused here too (``kunlun-operator render`` reads files no API server saw).
Must not talk to the API. Invariant: every ``SpecError`` names the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kunlun_operator.errors import SpecError
from kunlun_operator.spec.fields import read_choice, read_int, read_number, read_obj
from kunlun_operator.spec.values import SPECULATIVE_METHODS, SpeculativeMethod, SpeculativeSpec

PATH = "spec.runtime.speculative"
#: The runtime's ``prompt_lookup_max`` when the spec leaves it unset (what ``promptLookupMin`` is
#: checked against then).
RUNTIME_PROMPT_LOOKUP_MAX = 4
#: Each integer field's inclusive bounds (None: unbounded above).
INTEGER_BOUNDS: Mapping[str, tuple[int, int | None]] = {
    "numSpeculativeTokens": (1, 32),
    "promptLookupMax": (1, 32),
    "promptLookupMin": (1, 32),
    "suffixDecodingMaxTreeDepth": (1, 64),
    "suffixDecodingMaxCachedRequests": (0, None),
}
#: The fields that belong to one method; the others apply to both.
METHOD_OF: Mapping[str, SpeculativeMethod] = {
    "promptLookupMax": "ngram",
    "promptLookupMin": "ngram",
    "suffixDecodingMaxTreeDepth": "suffix",
    "suffixDecodingMaxCachedRequests": "suffix",
    "suffixDecodingMaxSpecFactor": "suffix",
    "suffixDecodingMinTokenProb": "suffix",
}
FIELDS = ("method", "numSpeculativeTokens", *METHOD_OF)


def parse_speculative(rt: Mapping[str, Any]) -> SpeculativeSpec | None:
    """``spec.runtime.speculative``; None (off) when absent.

    Raises:
        SpecError: an unknown field, a value of the wrong type or out of range, a field of the
            other method, or ``promptLookupMin`` above the longest n-gram.
    """
    if rt.get("speculative") is None:
        return None
    raw = read_obj(rt, "speculative", "spec.runtime")
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        raise SpecError(f"{PATH}.{unknown[0]}", f"unknown field; the fields are {', '.join(FIELDS)}")
    method = read_choice(raw, "method", PATH, SPECULATIVE_METHODS, default="ngram")
    for name, owner in METHOD_OF.items():
        if raw.get(name) is not None and owner != method:
            raise SpecError(f"{PATH}.{name}", f"applies to method {owner} only, got method {method}")
    parsed = SpeculativeSpec(
        method=method,
        num_speculative_tokens=_integer(raw, "numSpeculativeTokens"),
        prompt_lookup_max=_integer(raw, "promptLookupMax"),
        prompt_lookup_min=_integer(raw, "promptLookupMin"),
        suffix_decoding_max_tree_depth=_integer(raw, "suffixDecodingMaxTreeDepth"),
        suffix_decoding_max_cached_requests=_integer(raw, "suffixDecodingMaxCachedRequests"),
        suffix_decoding_max_spec_factor=read_number(raw, "suffixDecodingMaxSpecFactor", PATH, above=0.0),
        suffix_decoding_min_token_prob=read_number(
            raw, "suffixDecodingMinTokenProb", PATH, minimum=0.0, maximum=1.0
        ),
    )
    lookup_max = parsed.prompt_lookup_max or RUNTIME_PROMPT_LOOKUP_MAX
    if parsed.prompt_lookup_min is not None and parsed.prompt_lookup_min > lookup_max:
        unset = "" if parsed.prompt_lookup_max else ", the runtime's default"
        raise SpecError(
            f"{PATH}.promptLookupMin",
            f"{parsed.prompt_lookup_min} is above promptLookupMax ({lookup_max}{unset})",
        )
    return parsed


def _integer(raw: Mapping[str, Any], name: str) -> int | None:
    minimum, maximum = INTEGER_BOUNDS[name]
    return read_int(raw, name, PATH, minimum=minimum, maximum=maximum)

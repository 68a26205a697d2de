"""The runtime's ``--speculative-config``: ``spec.runtime.speculative`` as vLLM's JSON.

Owns: the JSON object (vLLM's snake_case keys, ``method`` always, the other keys only where the
spec sets them, so the runtime's defaults apply to the rest) and its one text form. It is an engine
flag like the others: in the ConfigMap and the container's arguments alike, so a change moves the
config hash and rolls the pods, for a Deployment and a LeaderWorkerSet's leader and workers. Pure.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from kunlun_operator.spec.values import InferenceSpec, SpeculativeSpec

SPECULATIVE_FLAG = "--speculative-config"


def speculative_config(speculative: SpeculativeSpec) -> dict[str, Any]:
    """vLLM's ``speculative_config``: ``method`` first, then each key set, in the spec's order."""
    return {
        field.name: value
        for field in dataclasses.fields(speculative)
        if (value := getattr(speculative, field.name)) is not None
    }


def speculative_flags(spec: InferenceSpec) -> list[tuple[str, Any]]:
    """``--speculative-config`` and its compact JSON (a fixed text: the config hash depends on it),
    or nothing with speculative decoding off."""
    speculative = spec.runtime.speculative
    if speculative is None:
        return []
    return [(SPECULATIVE_FLAG, json.dumps(speculative_config(speculative), separators=(",", ":")))]

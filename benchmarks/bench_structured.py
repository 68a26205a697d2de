"""Structured-output benchmark: decode speed with a JSON-schema constraint vs without, side by side.

Both sides run the same engine, prompts and token counts: the free side ignores EOS and the
constrained side's schema asks for a long array of records, so both generate ``--max-tokens``
tokens per request (finish reason ``length``). Decode time is measured after every request of the
batch has its first token (prefill excluded), at batch 1 and batch 8; the two sides alternate
``--reps`` times and the medians and their ratio are reported (this machine is shared and noisy:
only a ratio from one run means anything). Also reports the engine's own mask time per
constrained token (computed on a worker thread during the forward; applying them is in line) and
the constraint's compile time. ``--compare-overlap`` adds the constraint with masks computed in
line, interleaved with the two others. Writes JSON with ``--json``.

    .venv/bin/python benchmarks/bench_structured.py                 # the embedded SmolLM2
    .venv/bin/python benchmarks/bench_structured.py --quick --model DIR --json out.json  # smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from kunlun_runtime import LLM, SamplingParams
from kunlun_runtime.engine.llm_engine import LLMEngine
from kunlun_runtime.structured.params import StructuredOutputsParams

RECORD = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string", "maxLength": 24},
        "department": {"enum": ["sales", "risk", "operations", "it"]},
        "active": {"type": "boolean"},
        "balance": {"type": "number"},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["id", "name", "department", "active", "balance", "address"],
    "additionalProperties": False,
}
SCHEMA = {
    "type": "object",
    "properties": {"customers": {"type": "array", "items": RECORD, "minItems": 64}},
    "required": ["customers"],
    "additionalProperties": False,
}
PROMPTS = [
    "List the bank's customers as JSON.",
    "Export every account holder of the branch as JSON records.",
    "Give me the customer table in JSON.",
    "Write JSON with the customers of the risk and sales departments.",
    "Return a JSON document of customers with their addresses.",
    "Dump the customer master data as JSON.",
    "Produce JSON describing our retail customers.",
    "Serialize the customer list to JSON.",
]


def decode_rate(engine: LLMEngine, batch: int, max_tokens: int, constrained: bool, tag: str) -> float:
    """Decode tokens per second of one batch, from the step after every request's first token."""
    structured = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, structured_outputs=structured
    )
    ids = [f"{tag}-{i}" for i in range(batch)]
    for request_id, prompt in zip(ids, PROMPTS * (batch // len(PROMPTS) + 1), strict=False):
        engine.add_request(request_id, prompt, params)
    produced: dict[str, int] = {}
    finish: dict[str, str | None] = {}
    while len(produced) < batch or min(produced.values()) < 1:  # prefill: every request's first token
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
    before = sum(produced.values())
    began = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
            finish[out.request_id] = out.outputs[0].finish_reason
    elapsed = time.perf_counter() - began
    assert all(reason == "length" for reason in finish.values()), finish  # both sides: max_tokens each
    return (sum(produced.values()) - before) / elapsed


def run(
    model: str | None, batches: list[int], max_tokens: int, reps: int, other_overlap: bool = False
) -> dict[str, Any]:
    """``other_overlap``: also run the constrained side with masks computed the other way (on a
    worker thread during the forward, or in line), interleaved with the two others."""
    llm = LLM(model)
    engine = llm.engine
    engine.structured.compile(StructuredOutputsParams(regex="warm"))  # builds the vocabulary once
    began = time.perf_counter()
    engine.structured.compile(StructuredOutputsParams(json=SCHEMA))
    compile_ms = (time.perf_counter() - began) * 1e3
    decode_rate(engine, 1, 4, True, "warm-c")
    decode_rate(engine, 1, 4, False, "warm-f")
    results: dict[str, Any] = {
        "compile_ms": compile_ms,
        "max_tokens": max_tokens,
        "reps": reps,
        "batches": {},
    }
    for batch in batches:
        free, constrained, other = [], [], []
        mask_seconds = 0.0
        for rep in range(reps):
            free.append(decode_rate(engine, batch, max_tokens, False, f"f{batch}-{rep}"))
            mask_before = engine.structured.mask_seconds_total
            constrained.append(decode_rate(engine, batch, max_tokens, True, f"c{batch}-{rep}"))
            mask_seconds += engine.structured.mask_seconds_total - mask_before
            if other_overlap:
                engine.overlap_masks = not engine.overlap_masks
                other.append(decode_rate(engine, batch, max_tokens, True, f"o{batch}-{rep}"))
                engine.overlap_masks = not engine.overlap_masks
        mask_us = mask_seconds / (reps * batch * max_tokens) * 1e6
        row = {
            "free_tok_s": statistics.median(free),
            "constrained_tok_s": statistics.median(constrained),
            "ratio": statistics.median(constrained) / statistics.median(free),
            "mask_us_per_token": mask_us,
            "free_all": free,
            "constrained_all": constrained,
        }
        if other:
            row["other_overlap_tok_s"] = statistics.median(other)
            row["other_overlap_all"] = other
        results["batches"][str(batch)] = row
        print(
            f"batch {batch}: free {row['free_tok_s']:.1f} tok/s, JSON schema {row['constrained_tok_s']:.1f} tok/s, "
            f"ratio {row['ratio']:.3f}, mask {mask_us:.0f} us per constrained token "
            f"({'during the forward' if engine.overlap_masks else 'in line'})"
        )
        if other:
            where = "in line" if engine.overlap_masks else "on a worker thread during the forward"
            print(f"batch {batch}: JSON schema with masks {where}: {row['other_overlap_tok_s']:.1f} tok/s")
    print(f"schema compile: {compile_ms:.1f} ms (first use of the schema; the vocabulary already built)")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2)")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny settings for a smoke run")
    parser.add_argument(
        "--compare-overlap",
        action="store_true",
        help="also run the constraint with masks computed the engine's other way (thread or in line)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    max_tokens, reps = (16, 1) if args.quick else (args.max_tokens, args.reps)
    batches = [int(b) for b in args.batches.split(",")]
    results = run(args.model, batches, max_tokens, reps, other_overlap=args.compare_overlap)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

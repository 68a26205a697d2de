"""Grammar engines for structured outputs, side by side: llguidance, xgrammar, outlines-core.

For each constraint (JSON schemas from flat to large with ``$defs``/``$ref``/``anyOf``, any JSON
object, a regex, a choice) and each engine that imports: the tokenizer/vocabulary setup time, the
compile time (cold, and from the engine's cache or from the compiled artifact we would cache), then
a walk along one fixed valid output (a JSON instance encoded with the model's tokenizer, the same
token ids for every engine): at every position the mask is computed, the next token is checked
against it and consumed. The walk runs at batch 1 and batch 8 (8 independent matchers per step,
through the engine's parallel fill where it has one); masks are compared between engines position
by position. Engines run interleaved, ``--reps`` times, and medians/p99 are reported (shared
machines are noisy). Nothing here is imported by the runtime; engines that do not import are
skipped with the reason. xgrammar and outlines-core are not project dependencies:

    mkdir -p /tmp/gramlibs && .venv/bin/pip install --target /tmp/gramlibs --no-deps \\
        xgrammar apache-tvm-ffi outlines-core
    PYTHONPATH=/tmp/gramlibs .venv/bin/python benchmarks/bench_grammar_engines.py --json /tmp/grammar.json
    .venv/bin/python benchmarks/bench_grammar_engines.py --engines llguidance --quick --model DIR  # smoke
"""

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

BATCH = 8

# ---- workloads -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    kind: str  # "json" (spec: a schema), "regex" (spec: a pattern) or "choice" (spec: the strings)
    spec: Any
    instance: str  # one valid output: encoded with the tokenizer, it is the walk every engine takes


FLAT = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "active"],
}
NESTED = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "kind": {"enum": ["book", "article", "talk"]},
        "year": {"type": "integer"},
        "authors": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "affiliation": {"type": "string"}},
                "required": ["name"],
            },
        },
        "venue": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "country": {"enum": ["CN", "DE", "FR", "US"]}},
            "required": ["name", "country"],
        },
        "keywords": {"type": "array", "items": {"type": "string"}},
        "open_access": {"type": "boolean"},
    },
    "required": ["title", "kind", "year", "authors", "venue"],
}
NULLABLE_STRING = {"anyOf": [{"type": "string"}, {"type": "null"}]}
MONEY_REF, ADDRESS_REF = {"$ref": "#/$defs/Money"}, {"$ref": "#/$defs/Address"}
LARGE_PROPERTIES: dict[str, Any] = {
    "order_id": {"type": "string", "pattern": "^ORD-[0-9]{8}$"},
    "created_at": {"type": "string"},
    "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
    "channel": {"enum": ["web", "mobile", "store", "phone"]},
    "customer_name": {"type": "string"},
    "customer_email": {"type": "string"},
    "customer_phone": NULLABLE_STRING,
    "loyalty_tier": {"enum": ["none", "silver", "gold", "platinum"]},
    "loyalty_points": {"type": "integer"},
    "billing_address": ADDRESS_REF,
    "shipping_address": {"anyOf": [ADDRESS_REF, {"type": "null"}]},
    "items": {"type": "array", "items": {"$ref": "#/$defs/LineItem"}},
    "item_count": {"type": "integer"},
    "subtotal": MONEY_REF,
    "tax": MONEY_REF,
    "shipping_cost": MONEY_REF,
    "discount": {"anyOf": [MONEY_REF, {"type": "null"}]},
    "total": MONEY_REF,
    "payment_method": {"enum": ["card", "transfer", "wallet", "cash"]},
    "payment_reference": NULLABLE_STRING,
    "paid": {"type": "boolean"},
    "gift": {"type": "boolean"},
    "gift_message": NULLABLE_STRING,
    "coupon_codes": {"type": "array", "items": {"type": "string"}},
    "tags": {"type": "array", "items": {"type": "string"}},
    "priority": {"type": "integer"},
    "fragile": {"type": "boolean"},
    "weight_kg": {"type": "number"},
    "carrier": {"anyOf": [{"enum": ["dhl", "ups", "sf-express"]}, {"type": "null"}]},
    "tracking_number": NULLABLE_STRING,
    "notes": NULLABLE_STRING,
    "metadata": {
        "type": "object",
        "properties": {
            "source": {"type": "string"},
            "campaign": NULLABLE_STRING,
            "bucket": {"type": "integer"},
        },
        "required": ["source", "campaign", "bucket"],
    },
}
LARGE = {
    "$defs": {
        "Money": {
            "type": "object",
            "properties": {"amount": {"type": "number"}, "currency": {"enum": ["CNY", "EUR", "USD"]}},
            "required": ["amount", "currency"],
        },
        "Address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "postal_code": {"type": "string", "pattern": "^[0-9]{5,6}$"},
                "country": {"enum": ["CN", "DE", "FR", "US"]},
            },
            "required": ["street", "city", "postal_code", "country"],
        },
        "LineItem": {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "description": {"type": "string"},
                "quantity": {"type": "integer"},
                "unit_price": MONEY_REF,
            },
            "required": ["sku", "description", "quantity", "unit_price"],
        },
    },
    "type": "object",
    "properties": LARGE_PROPERTIES,
    "required": [name for name in LARGE_PROPERTIES if name not in ("tracking_number", "notes", "metadata")],
    "additionalProperties": False,
}


def money(amount: float) -> dict:
    return {"amount": amount, "currency": "EUR"}


ADDRESS = {"street": "12 Rue de Rivoli", "city": "Paris", "postal_code": "75004", "country": "FR"}
LARGE_INSTANCE = {
    "order_id": "ORD-20261201",
    "created_at": "2026-12-01T14:03:00Z",
    "status": "paid",
    "channel": "web",
    "customer_name": "Ada Lovelace",
    "customer_email": "ada@example.org",
    "customer_phone": None,
    "loyalty_tier": "gold",
    "loyalty_points": 1250,
    "billing_address": ADDRESS,
    "shipping_address": None,
    "items": [
        {"sku": "KLN-0001", "description": "Accelerator card", "quantity": 2, "unit_price": money(1999.0)},
        {"sku": "CBL-0420", "description": "PCIe riser cable", "quantity": 4, "unit_price": money(12.5)},
    ],
    "item_count": 6,
    "subtotal": money(4048.0),
    "tax": money(809.6),
    "shipping_cost": money(0),
    "discount": None,
    "total": money(4857.6),
    "payment_method": "card",
    "payment_reference": "pi_3Nq8",
    "paid": True,
    "gift": False,
    "gift_message": None,
    "coupon_codes": [],
    "tags": ["b2b", "priority"],
    "priority": 2,
    "fragile": True,
    "weight_kg": 3.75,
    "carrier": "dhl",
    "tracking_number": None,
    "notes": "Deliver to the loading dock.",
    "metadata": {"source": "checkout", "campaign": None, "bucket": 7},
}
LOG_LINE = r"[0-9]{4}-[0-9]{2}-[0-9]{2} [0-2][0-9]:[0-5][0-9] (INFO|WARN|ERROR) [a-z_]+: [A-Za-z ,.]{1,60}"
CHOICES = ("positive", "negative", "neutral", "mixed feelings")
CASES = (
    Case(
        "flat",
        "json",
        FLAT,
        json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "active": True}),
    ),
    Case(
        "nested",
        "json",
        NESTED,
        json.dumps(
            {
                "title": "Notes on the Analytical Engine",
                "kind": "article",
                "year": 1843,
                "authors": [{"name": "Ada Lovelace", "affiliation": "none"}, {"name": "L. F. Menabrea"}],
                "venue": {"name": "Scientific Memoirs", "country": "FR"},
                "keywords": ["computing", "Bernoulli numbers"],
                "open_access": True,
            }
        ),
    ),
    Case("large", "json", LARGE, json.dumps(LARGE_INSTANCE)),
    Case(
        "any_object",
        "json",
        {"type": "object"},
        json.dumps({"user": {"id": 7, "prefs": {"theme": "dark", "langs": ["zh", "en"]}}, "ok": True}),
    ),
    Case(
        "regex", "regex", LOG_LINE, "2026-12-01 14:03 WARN scheduler: queue depth above limit, shedding load."
    ),
    Case("choice", "choice", CHOICES, "neutral"),
)


def choice_regex(choices: tuple[str, ...]) -> str:
    """One alternation of the literal strings (escaping what a regex would read)."""
    special = set("\\.^$|?*+()[]{}")
    return "(" + "|".join("".join("\\" + c if c in special else c for c in s) for s in choices) + ")"


# ---- engines -----------------------------------------------------------------------------------


def load_tokenizer(model_dir: str):
    """(the HF fast tokenizer of ``model_dir``/tokenizer.json, its end-of-sequence id)."""
    from transformers import PreTrainedTokenizerFast

    directory = Path(model_dir)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    eos = config.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if not eos:
        raise SystemExit(f"{config_path}: no eos_token to end the walks with")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"), eos_token=eos)
    return tokenizer, tokenizer.eos_token_id


def dist_facts(distribution: str) -> dict:
    """Version, run-time Requires-Dist (extras left out) and installed size of a distribution."""
    from importlib import metadata

    dist = metadata.distribution(distribution)
    requires = [r for r in dist.requires or [] if "extra ==" not in r]
    size = sum(f.size or 0 for f in dist.files or [])
    return {"version": dist.version, "requires_dist": requires, "installed_mb": round(size / 1e6, 1)}


class Llguidance:
    """llguidance: a pristine compiled ``LLMatcher`` is the cache entry; a request deep-copies it."""

    name, module, distribution = "llguidance", "llguidance", "llguidance"
    cpu_note = (
        "Rust wheel (abi3), no Python dependencies; masks and parallel fill on CPU threads; "
        "no torch, no run-time compiler"
    )

    def __init__(self, threads: int) -> None:
        import llguidance
        import llguidance.numpy

        self.llg, self.fills, self.threads = llguidance, llguidance.numpy, threads

    def setup(self, tokenizer, eos_id: int) -> None:
        import llguidance.hf

        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, eos_token=eos_id)
        self.vocab_size = self.tokenizer.vocab_size
        self.executor = self.llg.LLExecutor(num_threads=self.threads)

    def compile(self, case: Case):
        matcher_class = self.llg.LLMatcher
        if case.kind == "json":  # vLLM's default: any whitespace between JSON tokens
            grammar = matcher_class.grammar_from_json_schema(
                case.spec, defaults={"whitespace_flexible": True}
            )
        elif case.kind == "regex":
            grammar = matcher_class.grammar_from_regex(case.spec)
        else:
            grammar = self.llg.grammar_from("choice", json.dumps(list(case.spec)))
        matcher = matcher_class(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def cached(self, case: Case, compiled):
        return compiled

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill_one(self, matcher, bitmask: np.ndarray, row: int) -> None:
        self.fills.fill_next_token_bitmask(matcher, bitmask, row)

    def fill(self, matchers: list, bitmask: np.ndarray) -> None:
        self.fills.fill_next_token_bitmask_par(
            self.executor, list(zip(matchers, range(len(matchers)), strict=True)), bitmask
        )

    def advance_one(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def advance(self, matchers: list, tokens: list[int]) -> list[bool]:
        return self.fills.consume_token_par(self.executor, list(zip(matchers, tokens, strict=True)))


class Xgrammar:
    """xgrammar: its ``GrammarCompiler`` caches compiled grammars itself (cleared for a cold compile)."""

    name, module, distribution = "xgrammar", "xgrammar", "xgrammar"
    cpu_note = (
        "C++ core through apache-tvm-ffi; imports torch at import time (bitmasks are torch "
        "tensors; numpy accepted through DLPack); Requires-Dist: torch, transformers, and triton "
        "on Linux x86_64 (used only to apply masks on a GPU)"
    )

    def __init__(self, threads: int) -> None:
        import xgrammar

        self.xgr, self.threads = xgrammar, threads

    def setup(self, tokenizer, eos_id: int) -> None:
        xgr = self.xgr
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=len(tokenizer), stop_token_ids=[eos_id]
        )
        self.vocab_size = info.vocab_size
        self.compiler = xgr.GrammarCompiler(info, max_threads=self.threads)
        self.batcher = xgr.BatchGrammarMatcher(max_threads=self.threads)

    def compile(self, case: Case):
        self.compiler.clear_cache()
        return self.cached(case, None)

    def cached(self, case: Case, compiled):
        if case.kind == "json":  # any_whitespace=True: vLLM's default
            return self.compiler.compile_json_schema(json.dumps(case.spec), any_whitespace=True)
        return self.compiler.compile_regex(case.spec if case.kind == "regex" else choice_regex(case.spec))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill_one(self, matcher, bitmask: np.ndarray, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def fill(self, matchers: list, bitmask: np.ndarray) -> None:
        self.batcher.batch_fill_next_token_bitmask(matchers, bitmask)

    def advance_one(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def advance(self, matchers: list, tokens: list[int]) -> list[bool]:
        return self.xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)


def byte_level_vocabulary(tokenizer) -> dict[bytes, list[int]]:
    """Token bytes -> ids, special tokens left out: what outlines-core's ``Vocabulary`` takes when
    it is not downloading the tokenizer itself. Byte-level BPE symbols are mapped back to bytes."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    symbols = {byte: byte for byte in printable}
    for byte in range(256):
        if byte not in symbols:
            symbols[byte] = 256 + len(symbols) - len(printable)
    to_byte = {chr(symbol): byte for byte, symbol in symbols.items()}
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    vocabulary: dict[bytes, list[int]] = {}
    for text, token_id in tokenizer.get_vocab().items():
        if token_id in special:
            continue
        key = bytes(to_byte[c] for c in text) if all(c in to_byte for c in text) else text.encode()
        vocabulary.setdefault(key, []).append(token_id)
    return vocabulary


class OutlinesCore:
    """outlines-core: a JSON schema becomes a regex, the regex an ``Index`` over the vocabulary (the
    artifact we would cache); a request walks a ``Guide`` over it. No batched fill: one call each."""

    name, module, distribution = "outlines-core", "outlines_core", "outlines_core"
    cpu_note = (
        "Rust wheel, no Python dependencies; a precomputed token index per regex (JSON schemas "
        "become regexes: bounded nesting, no recursion); no batched fill; its numpy/torch "
        "helpers need numba/torch"
    )

    def __init__(self, threads: int) -> None:
        import outlines_core
        import outlines_core.json_schema

        self.oc = outlines_core

    def setup(self, tokenizer, eos_id: int) -> None:
        self.vocabulary = self.oc.Vocabulary(eos_id, byte_level_vocabulary(tokenizer))
        self.vocab_size = len(tokenizer)

    def compile(self, case: Case):
        if case.kind == "json":
            regex = self.oc.json_schema.build_regex_from_schema(json.dumps(case.spec))
        else:
            regex = case.spec if case.kind == "regex" else choice_regex(case.spec)
        return self.oc.Index(regex, self.vocabulary)

    def cached(self, case: Case, compiled):
        return compiled

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def fill_one(self, guide, bitmask: np.ndarray, row: int) -> None:
        guide.write_mask_into(bitmask[row].ctypes.data, bitmask.shape[1], 4)

    def fill(self, matchers: list, bitmask: np.ndarray) -> None:
        for row, guide in enumerate(matchers):  # no batched fill: the loop is what a caller would write
            self.fill_one(guide, bitmask, row)

    def advance_one(self, guide, token: int) -> bool:
        try:
            guide.advance(token)
        except ValueError:  # no transition for this token
            return False
        return True

    def advance(self, matchers: list, tokens: list[int]) -> list[bool]:
        return [self.advance_one(guide, token) for guide, token in zip(matchers, tokens, strict=True)]


ENGINES = {engine.name: engine for engine in (Llguidance, Xgrammar, OutlinesCore)}
ENGINE_NAMES = tuple(ENGINES)
Engine = Llguidance | Xgrammar | OutlinesCore

# ---- measurement -------------------------------------------------------------------------------

SLOW_COMPILE_S = 2.0  # a cold compile slower than this is not repeated (keeps a run within minutes)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary_us(walks_ns: list[list[int]]) -> dict[str, float]:
    """Per-step statistics over all walks, in µs. ``worst_position_p50_us`` is the median over the
    walks of the dearest position: the engine's own tail, which a preempted step (4 or 8 ms on a
    loaded machine, the scheduler's time slice, at random positions) does not move."""
    us = [sample / 1000 for walk_ns in walks_ns for sample in walk_ns]
    steps = min(len(walk_ns) for walk_ns in walks_ns)
    per_position = [statistics.median(walk_ns[i] for walk_ns in walks_ns) / 1000 for i in range(steps)]
    return {
        "p50_us": statistics.median(us),
        "p99_us": percentile(us, 0.99),
        "mean_us": statistics.fmean(us),
        "worst_position_p50_us": max(per_position),
        "samples": len(us),
    }


def unpack(bitmask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """One bitmask row as booleans over the vocabulary (bit ``i % 32`` of word ``i // 32``)."""
    return np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:vocab_size].astype(bool)


def walk(engine: Engine, grammar, tokens: list[int], eos_id: int, batch: int, parallel: bool) -> dict:
    """Walk ``batch`` fresh matchers along ``tokens``: fill the masks, check that every row allows
    the next token, consume it; at the end the end-of-sequence token must be allowed. ``parallel``
    fills (and advances) through the engine's batched call, else one matcher after another.
    Returns the fill and advance times per step, row 0's mask at every position and where (if
    anywhere) the walk was rejected."""
    matchers = [engine.matcher(grammar) for _ in range(batch)]
    bitmask = np.full((batch, (engine.vocab_size + 31) // 32), -1, dtype=np.int32)
    fill_ns, advance_ns, masks = [], [], []
    for position, token in enumerate([*tokens, eos_id]):
        start = time.perf_counter_ns()
        if parallel:
            engine.fill(matchers, bitmask)
        else:
            for row, matcher in enumerate(matchers):
                engine.fill_one(matcher, bitmask, row)
        fill_ns.append(time.perf_counter_ns() - start)
        masks.append(bitmask[0].copy())
        allowed = (bitmask[:, token >> 5] >> (token & 31)) & 1
        if position == len(tokens) or not allowed.all():
            rejected = None if allowed.all() else position
            return {"fill_ns": fill_ns, "advance_ns": advance_ns, "masks": masks, "rejected_at": rejected}
        start = time.perf_counter_ns()
        if parallel:
            accepted = engine.advance(matchers, [token] * batch)
        else:
            accepted = [engine.advance_one(matcher, token) for matcher in matchers]
        advance_ns.append(time.perf_counter_ns() - start)
        if not all(accepted):
            return {"fill_ns": fill_ns, "advance_ns": advance_ns, "masks": masks, "rejected_at": position}
    raise AssertionError("unreachable: the loop returns at the end-of-sequence position")


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def compile_times(engine: Engine, case: Case, reps: int) -> tuple[dict, object]:
    """Median ms of: a cold compile; a cold compile up to its first mask (lazy engines pay there);
    a fresh matcher from the cache up to its first mask. Returns those and the compiled grammar."""
    bitmask = np.full((1, (engine.vocab_size + 31) // 32), -1, dtype=np.int32)
    cold, cold_first, cached_first = [], [], []
    grammar = None
    while len(cold) < reps:
        seconds, grammar = timed(lambda: engine.compile(case))
        seconds_first, _ = timed(lambda g=grammar: engine.fill_one(engine.matcher(g), bitmask, 0))
        cold.append(seconds)
        cold_first.append(seconds + seconds_first)
        if seconds > SLOW_COMPILE_S:
            break
    for _ in range(reps):
        seconds, _ = timed(lambda: engine.fill_one(engine.matcher(engine.cached(case, grammar)), bitmask, 0))
        cached_first.append(seconds)
    return {
        "compile_ms": 1000 * statistics.median(cold),
        "compile_to_first_mask_ms": 1000 * statistics.median(cold_first),
        "cached_to_first_mask_ms": 1000 * statistics.median(cached_first),
        "compile_reps": len(cold),
    }, grammar


class TokenClasses:
    """Which token ids are special and which contain whitespace: how mask differences are sorted."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
        self.special = np.zeros(len(tokenizer), dtype=bool)
        self.special[[i for i, t in tokenizer.added_tokens_decoder.items() if t.special]] = True
        self.whitespace = np.array([any(c.isspace() for c in text) for text in self.texts]) & ~self.special

    def kinds(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        return {
            "special": ids & self.special,
            "whitespace": ids & self.whitespace,
            "other": ids & ~self.special & ~self.whitespace,
        }


def compare_masks(masks: dict[str, list[np.ndarray]], classes: TokenClasses, tokens: list[int]) -> dict:
    """Positions where the engines' allowed sets differ; for each engine, at how many positions it
    allows tokens the others do not (its tokens beyond the common set), by kind, with an example."""
    names = list(masks)
    vocab_size = len(classes.texts)
    positions = min(len(m) for m in masks.values())
    report: dict = {
        "positions": positions,
        "differing_positions": 0,
        "count_mismatch_positions": 0,
        "wider": {name: {"special": 0, "whitespace": 0, "other": 0} for name in names},
        "examples": {},
    }
    for position in range(positions):
        rows = {name: unpack(masks[name][position], vocab_size) for name in names}
        common = np.logical_and.reduce(list(rows.values()))
        if all(np.array_equal(row, common) for row in rows.values()):
            continue
        report["differing_positions"] += 1
        report["count_mismatch_positions"] += len({int(row.sum()) for row in rows.values()}) > 1
        for name, row in rows.items():
            for kind, ids in classes.kinds(row & ~common).items():
                if not ids.any():
                    continue
                report["wider"][name][kind] += 1
                key = f"{name}/{kind}"
                if key not in report["examples"]:
                    report["examples"][key] = {
                        "position": position,
                        "after": classes.tokenizer.decode(tokens[:position])[-20:],
                        "allowed": {n: int(r.sum()) for n, r in rows.items()},
                        "extra": [classes.texts[i] for i in np.flatnonzero(ids)[:4]],
                    }
    return report


def import_probe(module: str) -> dict:
    """Import ``module`` in a fresh interpreter: its import time and which heavy modules it loads."""
    code = (
        "import sys, time, json; t = time.perf_counter(); import " + module + "; "
        "print(json.dumps({'import_s': time.perf_counter() - t, 'loads': "
        "[m for m in ('torch', 'triton', 'transformers', 'numpy') if m in sys.modules]}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(done.stdout)


WALKS = {"b1": (1, False), "b8_par": (BATCH, True), "b8_ser": (BATCH, False)}


def walk_case(
    engines: list, grammars: dict, tokens: list[int], eos_id: int, reps: int, results: dict
) -> dict:
    """Every walk of one case, engines interleaved; the first round (right after compiling) is kept
    apart as the cold walk. Returns row 0's masks of the second round's batch-1 walk per engine."""
    samples = {e.name: {f"{w}_{what}": [] for w in WALKS for what in ("fill", "advance")} for e in engines}
    masks = {}
    for rep in range(reps + 1):
        for engine in engines:
            entry = results[engine.name]
            for walk_name, (batch, parallel) in WALKS.items():
                done = walk(engine, grammars[engine.name], tokens, eos_id, batch, parallel)
                if done["rejected_at"] is not None:
                    entry.setdefault("rejected", {})[walk_name] = done["rejected_at"]
                if rep == 0:
                    if walk_name == "b1":
                        entry["first_walk_ms"] = (sum(done["fill_ns"]) + sum(done["advance_ns"])) / 1e6
                    continue
                if rep == 1 and walk_name == "b1":
                    masks[engine.name] = done["masks"]
                samples[engine.name][f"{walk_name}_fill"].append(done["fill_ns"])
                samples[engine.name][f"{walk_name}_advance"].append(done["advance_ns"])
    for name, store in samples.items():
        results[name].update({key: summary_us(walks) for key, walks in store.items() if walks and walks[0]})
    return masks


def bench_case(engines: list, case: Case, tokenizer, eos_id: int, classes: TokenClasses, args) -> dict:
    tokens = tokenizer.encode(case.instance, add_special_tokens=False)
    result: dict = {"tokens": len(tokens), "engines": {}}
    grammars = {}
    for engine in engines:
        try:
            result["engines"][engine.name], grammars[engine.name] = compile_times(
                engine, case, args.compile_reps
            )
        except Exception as error:  # an engine that cannot express the case: recorded, not fatal
            result["engines"][engine.name] = {"unsupported": f"{type(error).__name__}: {error}"[:300]}
    compiled = [engine for engine in engines if engine.name in grammars]
    masks = walk_case(compiled, grammars, tokens, eos_id, args.reps, result["engines"])
    for engine in compiled:
        entry = result["engines"][engine.name]
        entry["accepts_all"] = "rejected" not in entry
        if not entry["accepts_all"]:
            at = min(entry["rejected"].values())
            entry["rejected_after"] = tokenizer.decode(tokens[:at])[-24:]
            entry["rejected_token"] = tokenizer.decode(tokens[at : at + 1]) if at < len(tokens) else "<eos>"
    if len(masks) > 1:
        result["agreement"] = compare_masks(masks, classes, tokens)
    return result


def run(args: argparse.Namespace) -> dict:
    from kunlun_runtime.platforms.cpu_features import cpu_capabilities

    model_dir = args.model or str(resolve_default_dir())
    seconds, (tokenizer, eos_id) = timed(lambda: load_tokenizer(model_dir))
    results: dict = {
        "model": model_dir,
        "vocab_size": len(tokenizer),
        "threads": args.threads,
        "cpu": cpu_capabilities().describe(),
        "cpu_model": cpu_model_name(),
        "hf_tokenizer_load_s": seconds,
        "load_average_1min": {"start": os.getloadavg()[0]},
        "reps": args.reps,
        "batch": BATCH,
        "engines": {},
        "cases": {},
    }
    engines = []
    for name in args.engines:
        info: dict = {}
        results["engines"][name] = info
        try:
            engine = ENGINES[name](threads=args.threads)
        except ImportError as error:
            info["skipped"] = f"cannot import: {error}"
            print(f"skipping {name}: {info['skipped']}")
            continue
        info.update(dist_facts(engine.distribution))
        info["cpu_note"] = engine.cpu_note
        if not args.quick:
            info["import"] = import_probe(engine.module)
        info["setup_s"], _ = timed(lambda e=engine: e.setup(tokenizer, eos_id))
        engines.append(engine)
    classes = TokenClasses(tokenizer)
    for case in CASES:
        if not args.cases or case.name in args.cases:
            results["cases"][case.name] = bench_case(engines, case, tokenizer, eos_id, classes, args)
    results["load_average_1min"]["end"] = os.getloadavg()[0]
    results["triton_installed"] = importlib.util.find_spec("triton") is not None
    for engine in engines:
        results["engines"][engine.name]["outcome_here"] = outcome(engine.name, results)
    return results


def outcome(name: str, results: dict) -> str:
    """One line: what the engine did on this machine, case by case."""
    entries = {case: data["engines"][name] for case, data in results["cases"].items()}
    unsupported = [case for case, entry in entries.items() if "unsupported" in entry]
    rejected = [case for case, entry in entries.items() if entry.get("accepts_all") is False]
    walked = len(entries) - len(unsupported)
    line = f"compiled {walked}/{len(entries)} cases on this {results['cpu'].get('isa_tier')} CPU"
    line += f", rejected the valid output of: {', '.join(rejected)}" if rejected else ", accepted every token"
    return line + (f"; cannot express: {', '.join(unsupported)}" if unsupported else "")


def resolve_default_dir() -> Path:
    from kunlun_runtime.models.default_model import resolve_default_model

    return resolve_default_model()


def cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


# ---- report ------------------------------------------------------------------------------------

COLUMNS = [  # (header, width, format, value of one engine's entry)
    ("compile", 9, ".2f", lambda e: e["compile_ms"]),
    ("→1st", 9, ".2f", lambda e: e["compile_to_first_mask_ms"]),
    ("cached", 7, ".2f", lambda e: e["cached_to_first_mask_ms"]),
    ("walk1", 7, ".1f", lambda e: e["first_walk_ms"]),
    ("b1 p50", 7, ".1f", lambda e: e["b1_fill"]["p50_us"]),
    ("p99", 7, ".0f", lambda e: e["b1_fill"]["p99_us"]),
    ("mean", 6, ".0f", lambda e: e["b1_fill"]["mean_us"]),
    ("worst", 7, ".0f", lambda e: e["b1_fill"]["worst_position_p50_us"]),
    ("adv", 7, ".1f", lambda e: e["b1_advance"]["p50_us"]),
    ("b8par", 7, ".0f", lambda e: e["b8_par_fill"]["p50_us"]),
    ("p99", 6, ".0f", lambda e: e["b8_par_fill"]["p99_us"]),
    ("worst", 7, ".0f", lambda e: e["b8_par_fill"]["worst_position_p50_us"]),
    ("b8ser", 7, ".0f", lambda e: e["b8_ser_fill"]["p50_us"]),
    ("p99", 6, ".0f", lambda e: e["b8_ser_fill"]["p99_us"]),
    ("worst", 7, ".0f", lambda e: e["b8_ser_fill"]["worst_position_p50_us"]),
]


def print_engines(results: dict) -> None:
    print(f"{'engine':<14}{'version':>10}{'MB':>6}{'setup s':>9}{'import s':>10}  import loads / skipped")
    for name, info in results["engines"].items():
        if "skipped" in info:
            print(f"{name:<14}{'':>10}{'':>6}{'':>9}{'':>10}  {info['skipped']}")
            continue
        probe = info.get("import", {})
        loads = ",".join(probe.get("loads", [])) or probe.get("error", "-")
        print(
            f"{name:<14}{info['version']:>10}{info['installed_mb']:>6.1f}{info['setup_s']:>9.2f}"
            f"{probe.get('import_s', float('nan')):>10.2f}  {loads}"
        )
        print(f"{'':<14}requires: {', '.join(info['requires_dist']) or 'nothing'}")


def print_agreement(agreement: dict) -> None:
    if not agreement["differing_positions"]:
        print(f"    masks identical at all {agreement['positions']} positions")
        return
    print(
        f"    masks differ at {agreement['differing_positions']}/{agreement['positions']} positions "
        f"(allowed counts at {agreement['count_mismatch_positions']}); wider than the common set:"
    )
    for name, kinds in agreement["wider"].items():
        parts = [f"{kind} {count}" for kind, count in kinds.items() if count]
        example = agreement["examples"].get(f"{name}/other")
        if example:
            parts.append(f"e.g. after {example['after']!r}: {example['extra']}")
        if parts:
            print(f"      {name}: " + ", ".join(parts))


def print_report(results: dict) -> None:
    load = results["load_average_1min"]
    print(
        f"{results['cpu_model']} (tier {results['cpu'].get('isa_tier')}), {results['threads']} threads, "
        f"vocab {results['vocab_size']}, {results['reps']} reps, load average {load['start']:.1f} → "
        f"{load['end']:.1f}"
    )
    print_engines(results)
    print(
        "ms: compile, compile to the first mask, cache to the first mask, first walk (cold); µs per step: "
        "b1 mask (p50, p99, mean, worst position's p50), its advance (p50), "
        f"b8 = {results['batch']} masks by the batched call (par) and one by one (ser)"
    )
    print(f"{'case':<11}{'engine':<14}{'tok':>5}" + "".join(f"{h:>{w}}" for h, w, _, _ in COLUMNS) + "  ok")
    for case_name, case in results["cases"].items():
        for name, entry in case["engines"].items():
            row = f"{case_name:<11}{name:<14}{case['tokens']:>5}"
            if "unsupported" in entry:
                print(row + f"  unsupported: {entry['unsupported'][:80]}")
                continue
            row += "".join(f"{value(entry):>{w}{fmt}}" for _, w, fmt, value in COLUMNS)
            if entry["accepts_all"]:
                print(row + "  yes")
            else:
                print(row + f"  rejected {entry['rejected_token']!r} after {entry['rejected_after']!r}")
        if "agreement" in case:
            print_agreement(case["agreement"])
    print(f"triton {'is' if results['triton_installed'] else 'is not'} installed")
    for name, info in results["engines"].items():
        if "outcome_here" in info:
            print(f"{name}: {info['outcome_here']}. {info['cpu_note']}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--engines",
        default=",".join(ENGINE_NAMES),
        help=f"comma-separated, from {', '.join(ENGINE_NAMES)} (default: all)",
    )
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--model", help="a directory with tokenizer.json (default: the embedded SmolLM2)")
    parser.add_argument("--reps", type=int, default=5, help="rounds of walks after the cold one")
    parser.add_argument("--compile-reps", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="threads for the engines' batched fill and compile",
    )
    parser.add_argument("--quick", action="store_true", help="one rep, no import probes (the smoke test)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(args.engines) - set(ENGINE_NAMES)
    if unknown:
        parser.error(f"unknown engines {sorted(unknown)}; known: {', '.join(ENGINE_NAMES)}")
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = set(args.cases) - {case.name for case in CASES}
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; known: {', '.join(case.name for case in CASES)}")
    if args.quick:
        args.reps, args.compile_reps = 1, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = run(args)
    print_report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

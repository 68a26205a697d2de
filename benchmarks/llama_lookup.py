"""llama.cpp's model-free speculative decoding, run as its own programs (for bench_speculative.py).

Three sides, each one process per prompt (the programs decode one sequence), greedy, EOS ignored:

- ``plain``: ``llama-lookup`` with ``--spec-draft-n-max 0``: its decode loop with nothing drafted,
  llama.cpp's own baseline for the two below;
- ``lookup``: ``llama-lookup`` (``examples/lookup``): prompt lookup decoding from an n-gram cache
  of the context (1- to 4-grams, the most frequent continuation drafted);
- ``ngram-simple``: ``llama-speculative-simple --spec-type ngram-simple``: the last earlier
  occurrence of the latest n-gram, the m tokens after it drafted (the nearest to our ``ngram``).

The prompt goes in as text (the chat prompt our tokenizer renders); the SmolLM2 GGUF adds no BOS,
so llama.cpp tokenizes it to the same ids, which each run checks by count ("encoded N tokens").
Parsed from each program's own report: "decoded N tokens in S seconds", "n_drafted = D",
"n_accept = A". Both time their decode loop from the end of the prompt's evaluation (llama-lookup
evaluates the whole prompt first; llama-speculative-simple all but its last token, so its loop
holds one forward more), and count every token the loop sampled. Nothing here downloads anything:
the programs and the GGUF come from benchmarks/build_llama_cpp.sh.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

LOOKUP_ENV = "LLAMA_LOOKUP"  # path of llama-lookup; llama-speculative-simple is looked for beside it
GGUF_ENV = "LLAMA_LOOKUP_GGUF"  # the same weights as ours (build_llama_cpp.sh writes a BF16 one)
SIDES = ("plain", "lookup", "ngram-simple")

_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([0-9.]+) seconds")
_ENCODED = re.compile(r"encoded\s+(\d+) tokens in")
_DRAFTED = re.compile(r"n_drafted\s*=\s*(\d+)")
_ACCEPTED = re.compile(r"n_accept\s*=\s*(\d+)")


@dataclass(frozen=True, slots=True)
class LlamaRun:
    prompt_tokens: int  # the prompt as llama.cpp tokenized it
    decode_tokens: int  # tokens its decode loop sampled
    decode_seconds: float  # its decode loop's time
    drafted: int  # draft tokens it verified
    accepted: int  # of them, accepted


@dataclass(frozen=True, slots=True)
class LlamaLookup:
    lookup: Path  # llama-lookup
    speculative: Path  # llama-speculative-simple
    gguf: Path
    threads: int
    flash_attn: str  # on | off
    context: int  # -c: the KV cache's size in tokens


def from_env(threads: int, flash_attn: str, context: int) -> LlamaLookup | None:
    """The programs and GGUF named by ``LLAMA_LOOKUP`` / ``LLAMA_LOOKUP_GGUF``, or None when
    ``LLAMA_LOOKUP`` is unset. Raises SystemExit naming the variable when a path is missing."""
    lookup = os.environ.get(LOOKUP_ENV)
    if not lookup:
        return None
    gguf = os.environ.get(GGUF_ENV)
    speculative = Path(lookup).with_name("llama-speculative-simple")
    for name, path in (
        (LOOKUP_ENV, lookup),
        (GGUF_ENV, gguf),
        (f"{LOOKUP_ENV} (its directory)", speculative),
    ):
        if not path or not Path(path).is_file():
            raise SystemExit(
                f"{name}: {str(path)!r} is not a file; benchmarks/build_llama_cpp.sh DIR builds "
                "DIR/build/bin/llama-lookup and llama-speculative-simple and writes DIR/smollm2-BF16.gguf"
            )
    assert gguf is not None
    return LlamaLookup(Path(lookup), speculative, Path(gguf), threads, flash_attn, context)


def build_command(
    llama: LlamaLookup, side: str, prompt: str, max_tokens: int, draft_tokens: int, ngram_size: int
) -> list[str]:
    """The command line of one ``side`` (one of SIDES) for one prompt: ``draft_tokens`` drafted at
    most per step, ``ngram_size`` the n-gram ngram-simple matches. Raises ValueError for an unknown side."""
    if side in ("plain", "lookup"):
        program = llama.lookup
        spec = ["--spec-draft-n-max", str(draft_tokens if side == "lookup" else 0)]
    elif side == "ngram-simple":
        program = llama.speculative
        spec = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(ngram_size)]
        spec += ["--spec-ngram-simple-size-m", str(draft_tokens)]
    else:
        raise ValueError(f"side: {side!r} is not one of {SIDES}")
    return [
        str(program), "-m", str(llama.gguf), "-t", str(llama.threads), "-tb", str(llama.threads),
        "-c", str(llama.context), "-fa", llama.flash_attn, "-n", str(max_tokens), "--ignore-eos",
        "--temp", "0", "--top-k", "1", "--seed", "0", "--no-escape", "-p", prompt, *spec,
    ]  # fmt: skip


def parse_output(text: str) -> LlamaRun:
    """The figures of one program's report. Raises ValueError naming the line that is missing."""

    def find(pattern: re.Pattern[str], what: str) -> re.Match[str]:
        match = pattern.search(text)
        if match is None:
            raise ValueError(f"llama.cpp output has no {what!r} line:\n{text[-1500:]}")
        return match

    decoded = find(_DECODED, "decoded N tokens in S seconds")
    return LlamaRun(
        prompt_tokens=int(find(_ENCODED, "encoded N tokens").group(1)),
        decode_tokens=int(decoded.group(1)),
        decode_seconds=float(decoded.group(2)),
        drafted=int(find(_DRAFTED, "n_drafted = D").group(1)),
        accepted=int(find(_ACCEPTED, "n_accept = A").group(1)),
    )


def run(command: Sequence[str], timeout_seconds: float = 600) -> LlamaRun:
    """Run one program to its end and parse its report. Raises SystemExit if it fails."""
    done = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout_seconds, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{command[0]} failed ({done.returncode}): {done.stderr.strip()[-1500:]}")
    return parse_output(done.stdout + done.stderr)


@dataclass(frozen=True, slots=True)
class LlamaTotals:
    tok_s: float  # decode tokens over decode seconds, all prompts together
    acceptance_rate: float  # accepted / drafted (0 when nothing was drafted)
    tokens_per_forward: float  # sampled tokens per verification forward


def totals(runs: Sequence[LlamaRun]) -> LlamaTotals:
    """One figure per side over ``runs`` (all of a workload's prompts), as ours sums them."""
    tokens = sum(r.decode_tokens for r in runs)
    drafted = sum(r.drafted for r in runs)
    accepted = sum(r.accepted for r in runs)
    return LlamaTotals(
        tok_s=tokens / sum(r.decode_seconds for r in runs),
        acceptance_rate=accepted / drafted if drafted else 0.0,
        tokens_per_forward=tokens / max(1, tokens - accepted),
    )


def report(name: str, runs: dict[str, list[list[LlamaRun]]], ours: dict | None) -> dict:
    """llama.cpp's figures for one workload at batch 1, printed: each side's decode tok/s (the
    median over repeats of all prompts together) and acceptance (over every run), and, given ours
    (``plain_tok_s`` and ``spec_tok_s``), our speculative tok/s against each drafting side."""
    rates = {side: statistics.median(totals(repeat).tok_s for repeat in runs[side]) for side in runs}
    result: dict = {}
    parts = []
    for side, rate in rates.items():
        result[side] = {"tok_s": round(rate, 1), "vs_its_plain": round(rate / rates["plain"], 3)}
        part = f"{side} {rate:.1f} tok/s ({rate / rates['plain']:.3f}x"
        if side != "plain":
            every = totals([run for repeat in runs[side] for run in repeat])
            result[side]["acceptance_rate"] = round(every.acceptance_rate, 3)
            result[side]["tokens_per_forward"] = round(every.tokens_per_forward, 2)
            part += f", acceptance {every.acceptance_rate:.3f}, {every.tokens_per_forward:.2f} tok/forward"
        parts.append(part + ")")
    print(f"{name} batch 1 llama.cpp: " + ", ".join(parts))
    if ours is not None:
        versus = {side: ours["spec_tok_s"] / rate for side, rate in rates.items() if side != "plain"}
        result["ours_spec_vs"] = {side: round(ratio, 3) for side, ratio in versus.items()}
        result["ours_plain_vs_plain"] = round(ours["plain_tok_s"] / rates["plain"], 3)
        print(
            f"{name} batch 1 our speculative / llama.cpp: "
            + ", ".join(f"{side} {ratio:.3f}x" for side, ratio in versus.items())
            + f"; our plain / its plain {result['ours_plain_vs_plain']:.3f}x"
        )
    return result

"""``kunlun-runtime serve --speculative-config``: the real ``openai`` client gets the tokens it gets
without drafts, and /metrics carries vLLM's speculative-decoding counters, moving."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import openai

from tests.integration.server.live import start_serve_process
from tests.support.tiny_models import VOCAB_SIZE

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
# Prompts that repeat themselves, as a quoted context does: the n-gram drafts have something to
# copy. The last holds every token id, so whatever the model picks first has a continuation to
# draft: the first decode step drafts for sure (whether later drafts pay is decided from measured
# step times, which the first decode step has not seen yet).
PROMPTS = [
    [17, 42, 99, 7, 150, 33] * 3,
    [5, 6, 7, 8] * 4,
    [200, 201, 13, 201, 200, 64, 12] * 5,
    list(range(VOCAB_SIZE)),
]


def _counter(metrics: str, name: str) -> float:
    match = re.search(rf"^{name}_total\{{[^}}]*\}} (\S+)$", metrics, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def test_spec_decoding_server_answers_as_without_and_counts_drafts(tiny_model_dir: Path) -> None:
    answers = {}
    for mode in ("plain", "spec"):
        extra = ("--speculative-config", SPEC) if mode == "spec" else ()
        process, base_url = start_serve_process(tiny_model_dir, *extra)
        try:
            client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused")
            reply = client.completions.create(
                model=tiny_model_dir.name,
                prompt=PROMPTS,
                max_tokens=24,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            answers[mode] = [choice.text for choice in sorted(reply.choices, key=lambda c: c.index)]
            metrics = httpx.get(f"{base_url}/metrics", timeout=30).text
            if mode == "plain":
                assert "vllm:spec_decode_num_drafts" not in metrics  # only with --speculative-config
            else:
                drafts = _counter(metrics, "vllm:spec_decode_num_drafts")
                drafted = _counter(metrics, "vllm:spec_decode_num_draft_tokens")
                accepted = _counter(metrics, "vllm:spec_decode_num_accepted_tokens")
                # Whether later drafts pay is decided from measured step times: only the counts' consistency is fixed.
                assert drafts > 0 and drafted >= drafts and 0 <= accepted <= drafted
                first = re.search(
                    r'^vllm:spec_decode_num_accepted_tokens_per_pos_total\{[^}]*position="0"[^}]*\} (\S+)$',
                    metrics,
                    re.MULTILINE,
                )
                assert first and float(first.group(1)) <= accepted
        finally:
            process.terminate()
            assert process.wait(timeout=60) == 0
    assert answers["spec"] == answers["plain"]

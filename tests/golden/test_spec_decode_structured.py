"""Speculative decoding with structured outputs: a constrained request speculates, and under greedy
decoding its tokens equal decoding without drafts, token for token (JSON schema, regex, choice;
n-gram and suffix drafts) on the hidden-shape models and on the embedded model copying values
from its prompt into a JSON object; a draft its grammar forbids is never computed nor emitted, a
rejected draft never leaves its grammar advanced; sampled outputs hold to the grammar; masks
computed during the forward give the tokens of masks computed in line."""

import json
import re

import jsonschema
import numpy as np
import pytest

from kunlun_runtime import LLM, SamplingParams, StructuredOutputsParams
from kunlun_runtime.engine import spec_decode

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 8}  # the grammar cuts its drafts the same way
RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "code": {"type": "string", "pattern": "^[a-z]{3}-[0-9]{4}$"},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "code", "count", "ok"],
    "additionalProperties": False,
}
WORDS = r"([a-z]{2,6} ){3,6}[0-9]{2,4}"
CONSTRAINTS = {
    "json": StructuredOutputsParams(json=RECORD),
    "regex": StructuredOutputsParams(regex=WORDS),
    "choice": StructuredOutputsParams(choice=["the answer is alpha", "the answer is beta", "then gamma"]),
}
# Text whose pieces the constrained outputs can copy (an n-gram's continuation is often valid).
PROMPTS = [
    '{"name": "ab", "code": "abc-1234", "count": 12, "ok": true} ' * 3,
    "the thin the thin the thin ",
    "hello there, the answer is ",
]


@pytest.fixture(autouse=True)
def every_draft_is_worth_its_row(monkeypatch):
    """Whether a draft pays for its row depends on measured step times (noise); these tests are
    about what verification emits, so every request drafts as its budget allows."""
    monkeypatch.setattr(
        spec_decode, "draft_rows_worth_running", lambda cost, decoding, chances, measured=None: len(chances)
    )


def _llm(model_dir, spec, **options):
    options = {"dtype": "float32", "max_model_len": 256, **options}
    return LLM(str(model_dir), speculative_config=spec, **options) if spec else LLM(str(model_dir), **options)


def _tokens(llm, params, prompts=PROMPTS):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize(
    ("name", "config"), [("llama-gqa", SPEC), ("qwen2-bias", SPEC), ("qwen3-qknorm", SUFFIX)]
)
def test_constrained_greedy_tokens_equal_decoding_without_drafts(tiny_model_dirs, name, config):
    plain, spec = _llm(tiny_model_dirs[name], None), _llm(tiny_model_dirs[name], config)
    counters = spec.engine.spec.counters
    for kind, constraint in CONSTRAINTS.items():
        params = SamplingParams(temperature=0, max_tokens=48, structured_outputs=constraint)
        accepted = counters.num_accepted_tokens
        assert _tokens(spec, params) == _tokens(plain, params), kind
        assert counters.num_accepted_tokens > accepted, kind  # it really speculated
    assert spec.engine.block_pool.num_free == spec.engine.block_pool.num_blocks


def test_the_embedded_model_extracts_json_copying_from_its_prompt_token_for_token(smollm2_dir):
    schema = {
        "type": "object",
        "properties": {key: {"type": "string"} for key in ("invoice_number", "customer", "company", "date")},
        "required": ["invoice_number", "customer", "company", "date"],
        "additionalProperties": False,
    }
    text = "The invoice number is 4471-B, issued on 3 March 2024 to Zhang Wei of Harbin Steel Works."
    messages = [
        {"role": "user", "content": f"Extract the invoice number, customer, company and date as JSON: {text}"}
    ]
    params = SamplingParams(
        temperature=0, max_tokens=100, structured_outputs=StructuredOutputsParams(json=schema)
    )
    plain = LLM(str(smollm2_dir), dtype="float32", max_model_len=512).chat(messages, params)[0].outputs[0]
    llm = LLM(str(smollm2_dir), dtype="float32", max_model_len=512, speculative_config=SPEC)
    spec = llm.chat(messages, params)[0].outputs[0]
    assert spec.token_ids == plain.token_ids and spec.finish_reason == plain.finish_reason == "stop"
    extracted = json.loads(spec.text)
    jsonschema.validate(extracted, schema)
    assert extracted["invoice_number"] == "4471-B"  # a value copied from the prompt
    assert llm.engine.spec.counters.num_accepted_tokens >= 10  # copied through accepted drafts


def test_a_draft_the_grammar_forbids_is_never_verified_and_a_rejected_one_leaves_no_trace(tiny_model_dirs):
    """A test-local proposer drafts the tokens decoding without drafts emits next, then a token the
    grammar forbids ("#") in one step, a token it allows but the model does not choose in the
    next, and so on. The forbidden one is cut before the step; after every step the request's grammar is
    exactly that of a fresh grammar fed its output."""
    constraint = StructuredOutputsParams(regex=r"[0-9]{5}-[a-z]{5}")
    params = SamplingParams(temperature=0, max_tokens=20, structured_outputs=constraint)
    prompt = PROMPTS[0]
    reference = _tokens(_llm(tiny_model_dirs["llama-gqa"], None), params, [prompt])[0]
    llm = _llm(tiny_model_dirs["llama-gqa"], SPEC)
    engine = llm.engine
    forbidden = engine.tokenizer.encode("#", add_special_tokens=False)[0]

    def fed(tokens):
        grammar = engine.structured.new_matcher(constraint)
        assert all(grammar.accept(token) for token in tokens)
        return grammar

    def allowed_but_not_chosen(n):  # a token the grammar allows after reference[:n], but not reference[n]
        mask = engine.structured.fill_bitmask([fed(reference[:n])])[0]
        allowed = [t for t in range(engine.model_config.vocab_size) if (int(mask[t // 32]) >> (t % 32)) & 1]
        return [t for t in allowed if t != reference[n] and t not in engine.eos_token_ids][:1]

    steps = iter(range(1000))

    def drafts_for(request, k):
        n = len(request.output_token_ids)
        if n + 2 >= len(reference):
            return []
        if next(steps) % 2 == 0:
            drafts = [*reference[n : n + 2], forbidden, *reference[n + 2 : n + 3]]
        else:
            drafts = allowed_but_not_chosen(n) or [reference[n]]
        return drafts[:k]

    engine.spec.proposer.drafts = drafts_for
    request = engine.add_request("r", {"prompt_token_ids": engine.tokenizer.encode(prompt)}, params)
    verified: list[list[int]] = []
    while engine.has_unfinished_requests():
        engine.step()
        verified.append(list(request.spec_token_ids))
        if not request.is_finished:
            grammar = engine._tracked["r"].grammar
            expected = engine.structured.fill_bitmask([fed(request.output_token_ids)])
            assert np.array_equal(engine.structured.fill_bitmask([grammar]), expected)
    assert request.output_token_ids == reference
    assert all(forbidden not in drafts for drafts in verified)
    assert any(len(drafts) == 2 for drafts in verified)  # cut at "#": the two before it
    counters = engine.spec.counters
    assert counters.num_draft_tokens == sum(len(drafts) for drafts in verified)
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens  # some rejected
    assert engine.block_pool.num_free == engine.block_pool.num_blocks


def test_sampled_constrained_outputs_hold_to_the_grammar_and_reproduce(tiny_model_dirs):
    llm = _llm(tiny_model_dirs["llama-gqa"], SPEC, max_model_len=512)
    for kind in ("json", "regex"):
        params = SamplingParams(temperature=1.0, seed=5, max_tokens=128, structured_outputs=CONSTRAINTS[kind])
        outputs = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
        for output in outputs:
            assert output.finish_reason == "stop", output
            if kind == "json":
                jsonschema.validate(json.loads(output.text), RECORD)
            else:
                assert re.fullmatch(WORDS, output.text)
        assert _tokens(llm, params) == [o.token_ids for o in outputs]
    assert llm.engine.spec.counters.num_accepted_tokens > 0


def test_masks_during_the_forward_give_the_tokens_of_masks_in_line(tiny_model_dirs):
    cases = [SamplingParams(temperature=0, max_tokens=32, structured_outputs=c) for c in CONSTRAINTS.values()]
    cases.append(SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))  # a free one beside them
    prompts = [*PROMPTS, PROMPTS[0]]
    llm = _llm(tiny_model_dirs["llama-gqa"], SPEC)
    overlapped = [o.outputs[0].token_ids for o in llm.generate(prompts, cases)]
    llm.engine.overlap_masks = False
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, cases)] == overlapped
    assert llm.engine.spec.counters.num_accepted_tokens > 0

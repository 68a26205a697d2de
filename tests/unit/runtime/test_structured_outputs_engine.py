"""Structured outputs in the engine: constraints compile once (cached) or fail naming the field,
masks hold every sampled token to the grammar, constrained and free requests share a batch
without changing the free ones' tokens, and nothing leaks when a request ends early."""

import json
import math
import re

import jsonschema
import numpy as np
import pytest
import torch

from kunlun_runtime import LLM, SamplingParams
from kunlun_runtime.errors import InvalidRequestError
from kunlun_runtime.structured.bitmask import apply_token_bitmask, disallowed_from_words
from kunlun_runtime.structured.grammar import GrammarCompiler
from kunlun_runtime.structured.params import StructuredOutputsParams
from tests.support.tiny_models import TINY_SPECS, make_tiny_model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        "home": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "home"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp("structured") / "tiny", TINY_SPECS["llama-gqa"])
    return LLM(str(model_dir), dtype="float32", max_model_len=256, kv_cache_memory="8MiB")


def all_free(llm):
    pool = llm.engine.block_pool
    return pool.num_free == pool.num_blocks and not llm.engine.has_unfinished_requests()


def constrained(max_tokens=200, temperature=0.0, seed=None, **constraint):
    return SamplingParams(
        temperature=temperature,
        seed=seed,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(**constraint),
    )


def test_json_schema_outputs_validate_greedy_and_sampled(llm):
    prompts = ["person:", "record", "{", "hello world"]
    outs = llm.generate(prompts, constrained(json=PERSON))
    outs += llm.generate(prompts, constrained(json=json.dumps(PERSON), temperature=1.0, seed=7))
    for out in outs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion
        jsonschema.validate(json.loads(completion.text), PERSON)
    assert all_free(llm)


def test_regex_choice_json_object_and_lark_grammar_hold_under_sampling(llm):
    for seed in range(4):
        regex = llm.generate("d", constrained(regex=r"[0-9]{4}-(0[1-9]|1[0-2])", temperature=1.0, seed=seed))
        assert re.fullmatch(r"[0-9]{4}-(0[1-9]|1[0-2])", regex[0].outputs[0].text)
        choice = llm.generate(
            "c", constrained(choice=["yes", 'no "way"', "ünï ✓"], temperature=1.0, seed=seed)
        )
        assert choice[0].outputs[0].text in {"yes", 'no "way"', "ünï ✓"}
        lark = llm.generate(
            "g", constrained(grammar='start: "(" NUM ("+" NUM)* ")"\nNUM: /[1-9]/', seed=seed)
        )
        assert re.fullmatch(r"\([1-9](\+[1-9])*\)", lark[0].outputs[0].text)
    obj = llm.generate("o", constrained(json_object=True, max_tokens=120))[0].outputs[0]
    if obj.finish_reason == "stop":  # a random model may nest until max_tokens; a complete one parses
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.text.startswith("{")
    assert all_free(llm)


def test_constraint_that_cannot_finish_in_max_tokens_ends_with_length(llm):
    out = llm.generate("x", constrained(json=PERSON, max_tokens=4))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert '{"name": '.startswith(out.text)  # what was produced, a prefix of the only valid start
    assert all_free(llm)


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        ({"regex": "[a-", "source": "guided_regex"}, r"guided_regex: invalid regex constraint: .*unclosed"),
        (
            {"json": {"type": "bogus"}, "source": "response_format"},
            "response_format: invalid json constraint",
        ),
        ({"json": "{not json", "source": "guided_json"}, "guided_json: the JSON schema is not valid JSON"),
        ({"json": "[1, 2]"}, "structured_outputs: a JSON schema must be an object"),
        ({"grammar": "start: missing_rule"}, "structured_outputs: invalid grammar constraint"),
    ],
)
def test_invalid_constraints_are_refused_naming_the_field_and_leak_nothing(llm, constraint, message):
    source = constraint.get("source", "structured_outputs")
    with pytest.raises(InvalidRequestError, match=message) as error:
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(**constraint)))
    assert error.value.field == source and error.value.status_code == 400
    assert all_free(llm)


def test_params_need_exactly_one_bounded_constraint():
    with pytest.raises(InvalidRequestError, match=r"exactly one of .* got regex, json_object"):
        StructuredOutputsParams(regex="a", json_object=True, source="structured_outputs")
    with pytest.raises(InvalidRequestError, match="got none"):
        StructuredOutputsParams()
    with pytest.raises(InvalidRequestError, match="guided_choice: choice must list 1 to"):
        StructuredOutputsParams(choice=[], source="guided_choice")
    with pytest.raises(InvalidRequestError, match="at most 262144 are accepted"):
        StructuredOutputsParams(regex="a" * 300_000)
    spaced = StructuredOutputsParams(json='{"b":1,  "a": 2}').key()
    assert spaced == StructuredOutputsParams(json={"b": 1, "a": 2}).key()  # spacing does not matter
    assert spaced != StructuredOutputsParams(json={"a": 2, "b": 1}).key()  # key order does


def test_free_requests_get_the_same_tokens_alone_and_beside_constrained_ones(llm):
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["alpha beta", "the quick brown", "zz"]
    alone = [out.outputs[0].token_ids for out in llm.generate(prompts, free)]
    mixed_prompts = [prompts[0], "x", prompts[1], "y", prompts[2]]
    mixed_params = [free, constrained(json=PERSON), free, constrained(regex="[a-c]{30}"), free]
    mixed = llm.generate(mixed_prompts, mixed_params)
    assert [mixed[i].outputs[0].token_ids for i in (0, 2, 4)] == alone
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), PERSON)
    assert re.fullmatch("[a-c]{30}", mixed[3].outputs[0].text)


def test_prefix_cache_serves_constrained_requests(llm):
    prompt = {"prompt_token_ids": list(range(40, 40 + 64))}
    first = llm.generate(prompt, constrained(json=PERSON, max_tokens=100))[0]
    second = llm.generate(prompt, constrained(json=PERSON, max_tokens=100))[0]
    assert second.num_cached_tokens >= 48 and second.outputs[0].text == first.outputs[0].text


def test_compiled_grammars_are_cached_by_constraint_and_counted(llm):
    compiler = llm.engine.structured
    schema = {"type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"]}
    hits, json_requests = compiler.cache_hits_total, compiler.requests_total["json"]
    compiler.compile(StructuredOutputsParams(json=schema))  # the server compiles while preparing
    llm.generate("a", constrained(json=json.dumps(schema, indent=2)))  # the same schema spaced: a hit
    llm.generate("b", constrained(json=dict(reversed(list(schema.items())))))  # keys of the schema itself
    assert compiler.cache_hits_total - hits == 1
    assert compiler.requests_total["json"] - json_requests == 2
    assert compiler.mask_seconds_total > 0


def test_compiler_evicts_the_least_recently_used_grammar(llm):
    compiler = GrammarCompiler(
        (llm.engine.model_dir / "tokenizer.json").read_text(), 320, llm.engine.eos_token_ids, cache_size=2
    )
    a, b, c = (StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+"))
    compiler.compile(a)
    compiler.compile(b)
    compiler.compile(a)  # a is now the most recent
    compiler.compile(c)  # evicts b
    hits = compiler.cache_hits_total
    compiler.compile(a)
    compiler.compile(b)
    assert compiler.cache_hits_total - hits == 1


@pytest.mark.parametrize("vocab_size", [32, 33, 320, 49152 + 7])
def test_bitmask_masks_exactly_the_tokens_whose_bit_is_clear(vocab_size):
    generator = np.random.default_rng(vocab_size)
    words = (vocab_size + 31) // 32
    bitmask = generator.integers(-(2**31), 2**31 - 1, size=(2, words), dtype=np.int64).astype(np.int32)
    logits = torch.randn(3, vocab_size)
    expected = logits.clone()
    for i, row in enumerate((2, 0)):
        for token in range(vocab_size):
            if not (int(bitmask[i, token // 32]) >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    apply_token_bitmask(logits, bitmask, (2, 0))
    assert torch.equal(logits, expected)


def test_min_tokens_does_not_fight_a_complete_grammar(llm):
    params = SamplingParams(
        temperature=0,
        max_tokens=20,
        min_tokens=10,
        structured_outputs=StructuredOutputsParams(choice=["ok"]),
    )
    out = llm.generate("m", params)[0].outputs[0]
    assert out.text == "ok" and out.finish_reason == "stop"
    assert all_free(llm)


def test_abort_mid_constrained_generation_returns_every_block(llm):
    engine = llm.engine
    engine.add_request("abort-me", "q", constrained(json=PERSON))
    engine.step()
    engine.step()
    assert engine.abort_request("abort-me") is not None
    assert all_free(llm)


def test_property_order_is_part_of_the_constraint(llm):
    ab = {"type": "object", "properties": {"b": {"enum": [1]}, "a": {"enum": [2]}}, "required": ["b", "a"]}
    ba = {"type": "object", "properties": {"a": {"enum": [2]}, "b": {"enum": [1]}}, "required": ["a", "b"]}
    first = llm.generate("p", constrained(json=ab))[0].outputs[0].text
    second = llm.generate("p", constrained(json=ba))[0].outputs[0].text
    assert (first, second) == ('{"b": 1, "a": 2}', '{"a": 2, "b": 1}')


def test_a_schemas_own_x_guidance_cannot_turn_the_json_form_off(llm):
    schema = {
        "type": "object",
        "properties": {"a": {"enum": [1]}},
        "x-guidance": {"whitespace_flexible": True},
    }
    matcher = llm.engine.structured.new_matcher(StructuredOutputsParams(json=schema))
    tokens = llm.engine.tokenizer.encode('{\n  "a"', add_special_tokens=False)
    assert not all(matcher.accept(t) for t in tokens)


def test_masks_computed_during_the_forward_give_the_same_tokens_as_in_line(llm):
    prompts = ["one", "two two", "three"]
    params = [
        constrained(json=PERSON),
        SamplingParams(temperature=0, max_tokens=12),
        constrained(regex="[a-z]{9}"),
    ]
    assert llm.engine.overlap_masks  # the default
    overlapped = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    llm.engine.overlap_masks = False
    try:
        in_line = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.engine.overlap_masks = True
    assert overlapped == in_line


def test_logprobs_of_a_constrained_request_are_those_after_its_mask(llm):
    params = SamplingParams(
        temperature=0,
        max_tokens=4,
        logprobs=5,
        structured_outputs=StructuredOutputsParams(choice=["ab", "cd"]),
    )
    out = llm.generate("q", params)[0].outputs[0]
    first = out.logprobs[0]  # the first token can only be "a" or "c": the others have no mass
    finite = {token for token, entry in first.items() if entry.logprob > float("-inf")}
    allowed = {llm.engine.tokenizer.token_to_id("a"), llm.engine.tokenizer.token_to_id("c")}
    assert finite <= allowed and next(iter(first.values())).rank == 1
    assert abs(sum(math.exp(first[t].logprob) for t in finite) - 1.0) < 1e-5


def test_accelerator_unpacking_with_shifts_agrees_with_the_cpu_path():
    generator = np.random.default_rng(3)
    bitmask = generator.integers(-(2**31), 2**31 - 1, size=(3, 11), dtype=np.int64).astype(np.int32)
    logits = torch.zeros(3, 345)
    apply_token_bitmask(logits, bitmask, (0, 1, 2))
    assert torch.equal(disallowed_from_words(torch.from_numpy(bitmask), 345), torch.isneginf(logits))

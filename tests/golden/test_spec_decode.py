"""Speculative decoding (n-gram and suffix drafts) in the engine: under greedy decoding the tokens
equal decoding without drafts, token for token, on the hidden-shape models (both methods; FP32,
and BF16 on the AVX-512 kernels with steps past 16 rows), the embedded model, and under tensor
and pipeline parallelism; it interacts correctly with logprobs, stop strings, n > 1, structured
outputs, preemption and the feedback scheduler; seeds reproduce; suffix drafts come from the same
tenant's earlier outputs, never another's."""

import pytest
import torch

from kunlun_runtime import LLM, SamplingParams, StructuredOutputsParams
from kunlun_runtime.engine import spec_decode
from kunlun_runtime.layers import cpu_kernels
from tests.support.kernel_marks import needs_kernels

SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 16},
}
SPEC = SPECS["ngram"]
# Copy-heavy prompts (a phrase repeated, as a quoted context is), and plain ones.
PHRASES = [[17, 42, 99, 7, 150, 33], [5, 6, 7, 8], [200, 201, 13, 201, 200, 64, 12]]
PROMPTS = [phrase * (3 + k) for k, phrase in enumerate(PHRASES)] + [
    [(37 * i + 11 * k) % 290 + 3 for i in range(10 + 7 * k)] for k in range(5)
]


@pytest.fixture(autouse=True)
def every_draft_is_worth_its_row(monkeypatch):
    """Whether a draft pays for its row depends on measured step times (noise); these tests are
    about what verification emits, so every request drafts as its budget allows."""
    monkeypatch.setattr(
        spec_decode, "draft_rows_worth_running", lambda cost, decoding, chances, measured=None: len(chances)
    )


def _run(llm, params, prompts=PROMPTS):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0] for o in outputs]


def _llm(model_dir, spec, **options):
    options = {"dtype": "float32", "max_model_len": 256, **options}
    return LLM(str(model_dir), speculative_config=spec, **options) if spec else LLM(str(model_dir), **options)


@pytest.mark.parametrize("method", sorted(SPECS))
@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-bias", "qwen3-qknorm", "mistral"])
def test_greedy_tokens_equal_decoding_without_drafts(tiny_model_dirs, name, method):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    plain = _run(_llm(tiny_model_dirs[name], None), params)
    llm = _llm(tiny_model_dirs[name], SPECS[method])
    spec = _run(llm, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    for ours, reference in zip(spec, plain, strict=True):  # vLLM's shape: one entry per token
        assert len(ours.logprobs) == len(ours.token_ids)
        for mine, theirs, token in zip(ours.logprobs, reference.logprobs, ours.token_ids, strict=True):
            assert set(mine) == set(theirs) and mine[token].logprob == pytest.approx(
                theirs[token].logprob, abs=1e-4
            )
    counters = llm.engine.spec.counters
    assert counters.num_accepted_tokens > 0 and counters.num_drafts > 0
    assert llm.engine.block_pool.num_free == llm.engine.block_pool.num_blocks


@needs_kernels(torch.bfloat16)
@pytest.mark.parametrize("method", sorted(SPECS))
def test_greedy_tokens_equal_decoding_without_drafts_in_bf16_with_steps_past_16_rows(
    tiny_model_dirs, method, monkeypatch
):
    """The default dtype, on the AVX-512 tier's kernels: 8 requests and their drafts fill steps of
    up to 40 rows (the linears in passes of up to 32, one call of the layer stack), and each row
    still gives what it gives decoded alone."""
    rows = []
    real = cpu_kernels.decode_layers
    monkeypatch.setattr(cpu_kernels, "decode_layers", lambda x, *a: rows.append(x.shape[0]) or real(x, *a))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = _run(_llm(tiny_model_dirs["llama-gqa"], None, dtype="bfloat16"), params)
    llm = _llm(tiny_model_dirs["llama-gqa"], SPECS[method], dtype="bfloat16")
    spec = _run(llm, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    # n-gram drafts fill steps past 16 rows here; suffix drafts fewer on these prompts (up to 13)
    assert max(rows) > (16 if method == "ngram" else 8)
    assert llm.engine.spec.counters.num_accepted_tokens > 0


def test_the_engine_reports_every_pure_decode_step_to_the_draft_price(tiny_model_dirs):
    # The prompts are prefilled in the first step; every step after it is a pure decode step,
    # reported with its draft rows (which are all verified) and its forward's time.
    llm = _llm(tiny_model_dirs["llama-gqa"], SPEC)
    price = llm.engine.spec.price
    observe = price.observe
    seen = []

    def recording(batch, draft_rows, seconds):
        seen.append((len(batch), draft_rows, seconds))
        observe(batch, draft_rows, seconds)

    price.observe = recording
    _run(llm, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), PROMPTS[:3])
    assert seen and all(1 <= size <= 3 and seconds > 0 for size, _, seconds in seen)
    assert sum(rows for _, rows, _ in seen) == llm.engine.spec.counters.num_draft_tokens > 0


def test_the_embedded_model_copies_a_quoted_text_token_for_token(smollm2_dir):
    text = "The invoice number is 4471-B, issued on 3 March to Zhang Wei of Harbin Steel. "
    messages = [{"role": "user", "content": f"Repeat this text exactly, twice: {text}"}]
    params = SamplingParams(temperature=0, max_tokens=48)
    plain = LLM(str(smollm2_dir), dtype="float32", max_model_len=512).chat(messages, params)[0].outputs[0]
    llm = LLM(str(smollm2_dir), dtype="float32", max_model_len=512, speculative_config=SPEC)
    spec = llm.chat(messages, params)[0].outputs[0]
    assert spec.token_ids == plain.token_ids and spec.text == plain.text
    assert llm.engine.spec.counters.num_accepted_tokens >= 10  # it really copied


def _invoices(count: int) -> str:
    """A document of `count` invoice lines, every field varied, for the model to quote."""
    names = ["Zhang Wei", "Li Na", "Wang Fang", "Liu Yang", "Chen Jing", "Zhao Lei", "Sun Mei", "Zhou Tao"]
    cities = ["Harbin", "Wuhan", "Xi'an", "Shenzhen", "Chengdu", "Dalian", "Nanjing"]
    goods = ["steel coil", "copper wire", "cement", "glass panels", "diesel", "timber", "fertiliser"]
    return "\n".join(
        f"Invoice {4400 + 37 * i}-{'ABCDEFG'[i % 7]}: {3 + i * 5 % 17} tonnes of {goods[i * 3 % 7]} for "
        f"{names[i % 8]} of {cities[i * 5 % 7]}, {1 + i % 28} {['March', 'April', 'May'][i % 3]}, "
        f"{(i * 7919) % 90000 + 1000} yuan."
        for i in range(count)
    )


def test_the_embedded_model_quotes_long_contexts_token_for_token_on_two_threads(smollm2_dir):
    # Decode attention over ~1,800 keys is split across two threads, and a row verified with drafts
    # shares its keys' reading with them: each row's attention must still be the bits it has
    # decoded alone, or near-ties in the embedded model's logits let the outputs part (they did,
    # when a split fell where the step's rows put it: there this prompt's logprobs parted at the
    # sixth token). One stream, as a client's alone.
    document = _invoices(48)
    ask = "Copy every invoice for a customer in Harbin, exactly as written."
    conversation = [{"role": "user", "content": f"{document}\n\n{ask}"}]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=0)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        plain_llm = LLM(str(smollm2_dir), max_model_len=2048, enable_prefix_caching=False)
        plain = plain_llm.chat(conversation, params)[0].outputs[0]
        llm = LLM(str(smollm2_dir), max_model_len=2048, enable_prefix_caching=False, speculative_config=SPEC)
        spec = llm.chat(conversation, params)[0].outputs[0]
        prompt_tokens = len(llm.engine.tokenizer.encode(document))
    finally:
        torch.set_num_threads(threads_before)
    assert prompt_tokens > 1200  # long enough that two threads split each row's keys
    assert spec.token_ids == plain.token_ids
    # The logprobs show a difference in any layer's attention before it flips a token.
    for token, mine, reference in zip(spec.token_ids, spec.logprobs, plain.logprobs, strict=True):
        assert mine[token].logprob == reference[token].logprob
    assert llm.engine.spec.counters.num_accepted_tokens >= 16  # it really copied


@pytest.mark.parametrize("method", sorted(SPECS))
@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_parallel_ranks_verify_drafts_as_one_rank(tiny_model_dirs, layout, method):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = _run(_llm(tiny_model_dirs["llama-gqa"], None), params, PROMPTS[:4])
    with _llm(tiny_model_dirs["llama-gqa"], SPECS[method], **layout) as llm:
        assert [o.token_ids for o in _run(llm, params, PROMPTS[:4])] == [o.token_ids for o in plain]
        assert llm.engine.spec.counters.num_accepted_tokens > 0


def test_stop_strings_n_and_structured_outputs_in_one_batch(tiny_model_dirs):
    model_dir = tiny_model_dirs["llama-gqa"]
    choice = StructuredOutputsParams(choice=["alpha", "beta"])
    cases = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2),
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=choice),
    ]
    prompts = PROMPTS[:3]
    plain_llm, spec_llm = _llm(model_dir, None), _llm(model_dir, SPEC)
    plain = [o.outputs for o in plain_llm.generate([{"prompt_token_ids": p} for p in prompts], cases)]
    spec = [o.outputs for o in spec_llm.generate([{"prompt_token_ids": p} for p in prompts], cases)]
    assert [[c.token_ids for c in o] for o in spec] == [[c.token_ids for c in o] for o in plain]
    assert spec[2][0].text in ("alpha", "beta")
    # A stop string inside a run of accepted drafts ends the output exactly where decoding one
    # token at a time ends it.
    full = plain[0][0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    stopped = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    ours = spec_llm.generate({"prompt_token_ids": prompts[0]}, stopped)[0].outputs[0]
    theirs = plain_llm.generate({"prompt_token_ids": prompts[0]}, stopped)[0].outputs[0]
    assert (
        (ours.text, ours.finish_reason)
        == (theirs.text, theirs.finish_reason)
        == (full[: full.index(stop)], "stop")
    )
    assert spec_llm.engine.block_pool.num_free == spec_llm.engine.block_pool.num_blocks


@pytest.mark.parametrize("policy", ["fixed", "feedback"])
def test_preemption_on_a_tiny_pool_keeps_the_tokens(tiny_model_dirs, policy):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    options = {
        "block_size": 8,
        "kv_cache_memory_bytes": 24 * 2 * 2 * (1024 + 64),
        "scheduling_policy": policy,
    }
    plain = _run(_llm(tiny_model_dirs["llama-gqa"], None), params, PROMPTS[:6])
    llm = _llm(tiny_model_dirs["llama-gqa"], SPEC, max_model_len=128, **options)
    assert [o.token_ids for o in _run(llm, params, PROMPTS[:6])] == [o.token_ids for o in plain]
    assert llm.engine.scheduler.num_preemptions_total > 0  # the pool really was too small
    assert llm.engine.block_pool.num_free == llm.engine.block_pool.num_blocks


def test_seeded_sampling_reproduces(tiny_model_dirs):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, ignore_eos=True, seed=123)
    llm = _llm(tiny_model_dirs["llama-gqa"], SPEC)
    first = [o.token_ids for o in _run(llm, params, PROMPTS[:3])]
    assert [o.token_ids for o in _run(llm, params, PROMPTS[:3])] == first


def _serve(llm, request_id, prompt, params, cache_salt):
    """One request through the engine under ``cache_salt``: its tokens and the drafts it accepted."""
    engine = llm.engine
    accepted = engine.spec.counters.num_accepted_tokens
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params, cache_salt=cache_salt)
    token_ids = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                token_ids = list(output.outputs[0].token_ids)
    return token_ids, engine.spec.counters.num_accepted_tokens - accepted


def test_suffix_drafts_come_from_the_same_tenants_earlier_outputs(tiny_model_dirs):
    """The same question again from the same tenant drafts the cached answer and accepts more of
    it; from another tenant (another cache_salt) it drafts exactly as the first time, from its own
    tokens only."""
    llm = _llm(tiny_model_dirs["llama-gqa"], SPECS["suffix"])
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompt = PROMPTS[4]  # nothing in it to copy
    first = _serve(llm, "first", prompt, params, "tenant-a")
    again = _serve(llm, "again", prompt, params, "tenant-a")
    other = _serve(llm, "other", prompt, params, "tenant-b")
    assert first[0] == again[0] == other[0]  # greedy: the same tokens whatever was drafted
    assert other[1] == first[1]
    assert again[1] > first[1]

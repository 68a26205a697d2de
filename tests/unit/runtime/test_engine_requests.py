"""Engine request handling: bad input is refused with the field named and leaks nothing; stop
conditions, n > 1, seeds, chat templates and aborts behave."""

import json

import pytest

from kunlun_runtime import LLM, SamplingParams
from kunlun_runtime.errors import ConfigError, InvalidRequestError
from tests.support.tiny_models import CHATML, TINY_SPECS, make_tiny_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp("engine") / "tiny", TINY_SPECS["llama-gqa"])
    return LLM(str(model_dir), dtype="float32", max_model_len=64, kv_cache_memory="4MiB")


def all_free(llm):
    pool = llm.engine.block_pool
    return pool.num_free == pool.num_blocks and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ({"prompt_token_ids": list(range(64))}, "maximum context length is 64 tokens, but the prompt has 64"),
        ("", "prompt: must not be empty"),
        ({"prompt_token_ids": [1, 99999]}, "token ids out of range"),
        (3.5, "must be a string or a list of token ids"),
    ],
)
def test_bad_prompts_are_refused_with_the_field_and_leak_nothing(llm, prompt, message):
    with pytest.raises(InvalidRequestError, match=message) as error:
        llm.generate(prompt, SamplingParams())
    assert error.value.field == "prompt" and error.value.status_code == 400
    assert all_free(llm)


def test_mistral_refuses_max_model_len_beyond_its_sliding_window(tmp_path):
    spec = TINY_SPECS["mistral"]
    model_dir = make_tiny_model(
        tmp_path / "mistral", type(spec)(**{**spec.__dict__, "extra": {"sliding_window": 32}})
    )
    with pytest.raises(ConfigError, match="exceeds the sliding window \\(32\\)") as error:
        LLM(str(model_dir), dtype="float32", max_model_len=48)
    assert error.value.field == "max_model_len"
    assert LLM(str(model_dir), dtype="float32").engine.max_model_len == 32


def test_kv_budget_too_small_is_a_clear_error(llm):
    with pytest.raises(ConfigError, match=r"kv_cache_memory: .* one sequence of max_model_len=64 needs"):
        LLM(str(llm.engine.model_dir), dtype="float32", max_model_len=64, kv_cache_memory="4KiB")


def test_max_tokens_and_length_limit_finish_with_length(llm):
    out = llm.generate(
        {"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    )
    assert len(out[0].outputs[0].token_ids) == 5 and out[0].outputs[0].finish_reason == "length"
    out = llm.generate(
        {"prompt_token_ids": list(range(60))}, SamplingParams(max_tokens=None, ignore_eos=True)
    )
    assert len(out[0].outputs[0].token_ids) == 4  # 60 + 4 = max_model_len


def test_stop_token_ids_and_stop_strings_end_generation(llm):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    full = llm.generate("the", greedy)[0].outputs[0]
    stop_token = full.token_ids[3]
    first = full.token_ids.index(stop_token)
    out = llm.generate(
        "the", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_token])
    )
    assert out[0].outputs[0].token_ids == full.token_ids[: first + 1]
    assert (out[0].outputs[0].finish_reason, out[0].outputs[0].stop_reason) == ("stop", stop_token)
    stop_text = full.text[4:6]
    cut = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop_text])
    stopped = llm.generate("the", cut)[0].outputs[0]
    assert stopped.text == full.text[: full.text.index(stop_text)]
    assert stopped.stop_reason == stop_text
    assert all_free(llm)


def test_n_samples_are_distinct_and_reproducible_with_a_seed(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=42, max_tokens=8, ignore_eos=True)
    first = llm.generate("the", params)[0]
    second = llm.generate("the", params)[0]
    assert [o.index for o in first.outputs] == [0, 1, 2]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in second.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1


def test_chat_applies_the_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2, ignore_eos=True))[0]
    expected = llm.tokenizer.encode(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    assert out.prompt_token_ids == expected


def test_abort_returns_every_block(llm):
    engine = llm.engine
    engine.add_request(
        "x", {"prompt_token_ids": list(range(30))}, SamplingParams(max_tokens=20, ignore_eos=True)
    )
    engine.step()
    assert engine.block_pool.num_free < engine.block_pool.num_blocks
    aborted = engine.abort_request("x")
    assert aborted.outputs[0].finish_reason == "abort"
    assert engine.abort_request("x") is None
    assert all_free(llm)


def test_second_turn_reuses_the_first_turns_blocks(llm):
    engine = llm.engine
    history = list(range(40, 80 - 20))
    llm.generate({"prompt_token_ids": history}, SamplingParams(max_tokens=1))
    second = llm.generate({"prompt_token_ids": [*history, 5, 6]}, SamplingParams(max_tokens=1))[0]
    assert second.num_cached_tokens == (len(history) // engine.config.block_size) * engine.config.block_size
    assert engine.kv.num_prefix_hits > 0


def test_a_bad_prompt_in_a_batch_aborts_the_ones_already_queued(llm):
    with pytest.raises(InvalidRequestError, match="prompt: must not be empty"):
        llm.generate(["the", ""], SamplingParams(n=2, max_tokens=4))
    assert all_free(llm)


@pytest.mark.parametrize(
    ("params", "field", "message"),
    [
        (SamplingParams(max_tokens=5), "max_tokens",
         r"max_tokens: 5 is too large: .* is 64 tokens and the request has 60 input tokens \(5 > 64 - 60\)"),
        (SamplingParams(max_tokens=None, min_tokens=5), "min_tokens", r"min_tokens: 5 is too large"),
    ],
)  # fmt: skip
def test_a_request_that_cannot_fit_the_context_is_refused_not_cut_short(llm, params, field, message):
    with pytest.raises(InvalidRequestError, match=message) as error:
        llm.generate({"prompt_token_ids": list(range(60))}, params)
    assert error.value.field == field and error.value.status_code == 400
    assert all_free(llm)
    out = llm.generate({"prompt_token_ids": list(range(60))}, SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


TOOLS_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n' }}{% for tool in tools %}{{ tool['function']['name'] + '\\n' }}"
    "{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}" + CHATML
)


def test_chat_passes_tools_and_template_variables_to_a_template_that_uses_them(llm, tmp_path):
    model_dir = make_tiny_model(tmp_path / "tools", TINY_SPECS["llama-gqa"])
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TOOLS_TEMPLATE + "{% if greeting %}{{ greeting }}{% endif %}"
    config_path.write_text(json.dumps(config))
    with_tools = LLM(str(model_dir), dtype="float32", max_model_len=64, kv_cache_memory="4MiB")
    tool = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}}
    out = with_tools.chat(
        [{"role": "user", "content": "hi"}],
        SamplingParams(max_tokens=1),
        tools=[tool],
        chat_template_kwargs={"greeting": "yo"},
    )[0]
    expected = (
        "<|im_start|>system\nclock\n<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo"
    )
    assert out.prompt_token_ids == with_tools.tokenizer.encode(expected, add_special_tokens=False)
    with pytest.raises(ValueError, match="does not use tools"):  # the plain template would drop them
        llm.chat([{"role": "user", "content": "hi"}], tools=[tool])
    with pytest.raises(
        ValueError, match="chat_template_kwargs: add_generation_prompt, tools are set by chat"
    ):
        with_tools.chat(
            [{"role": "user", "content": "hi"}],
            chat_template_kwargs={"tools": [], "add_generation_prompt": 0},
        )


def test_a_prompt_longer_than_a_step_is_prefilled_in_chunks_in_bf16(tmp_path):
    """A step of nothing but a prompt's first chunk samples no row: the BF16 kernels, which refuse
    an empty batch, must not be asked for logits (that step used to kill the engine)."""
    model_dir = make_tiny_model(tmp_path / "tiny", TINY_SPECS["llama-gqa"])
    prompt = {"prompt_token_ids": [(7 * i) % 200 + 3 for i in range(100)]}
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    chunked = LLM(str(model_dir), dtype="bfloat16", max_model_len=128, max_num_batched_tokens=32)
    whole = LLM(str(model_dir), dtype="bfloat16", max_model_len=128, max_num_batched_tokens=128)
    got = chunked.generate(prompt, params)[0].outputs[0].token_ids
    assert len(got) == 4
    assert got == whole.generate(prompt, params)[0].outputs[0].token_ids
    assert all_free(chunked)

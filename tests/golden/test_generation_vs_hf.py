"""Greedy continuations token-identical to HF transformers (FP32), in batches that mix prefill
chunks and decodes, with logprobs equal to the reference's."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from kunlun_runtime import LLM, SamplingParams
from tests.support.tiny_models import TINY_SPECS

PROMPTS = [[5], [17, 99, 3, 250, 8, 41, 7], [(11 * i + 1) % 300 for i in range(40)]]
NEW_TOKENS = 32


def hf_greedy(model_dir, prompt):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    tokens = ids.sequences[0, len(prompt) :].tolist()
    logprobs = [
        torch.log_softmax(score[0].float(), -1)[t].item() for score, t in zip(ids.scores, tokens, strict=True)
    ]
    return tokens, logprobs


@pytest.mark.parametrize("name", sorted(TINY_SPECS))
def test_batched_chunked_greedy_equals_hf(tiny_model_dirs, name):
    # A 16-token budget forces the 40-token prompt into chunks that share steps with decodes.
    llm = LLM(
        str(tiny_model_dirs[name]),
        dtype="float32",
        kv_cache_memory="8MiB",
        block_size=8,
        max_num_batched_tokens=16,
        max_model_len=128,
    )
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        tokens, logprobs = hf_greedy(tiny_model_dirs[name], prompt)
        completion = output.outputs[0]
        assert completion.token_ids == tokens
        assert completion.finish_reason == "length"
        ours = [position[token].logprob for position, token in zip(completion.logprobs, tokens, strict=True)]
        assert ours == pytest.approx(logprobs, abs=1e-4)
    assert llm.engine.block_pool.num_free == llm.engine.block_pool.num_blocks


def test_prompt_logprobs_match_hf(tiny_model_dirs):
    model_dir = tiny_model_dirs["llama-gqa"]
    prompt = PROMPTS[2]
    llm = LLM(
        str(model_dir), dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=16, max_model_len=128
    )
    output = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch.log_softmax(reference(torch.tensor([prompt])).logits[0], -1)
    assert output.prompt_logprobs[0] is None
    got = [
        position[token].logprob
        for position, token in zip(output.prompt_logprobs[1:], prompt[1:], strict=True)
    ]
    want = [expected[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
    assert got == pytest.approx(want, abs=1e-4)

"""The embedded SmolLM2-135M-Instruct: greedy output token-identical to HF FP32, golden CLI passes."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from kunlun_runtime import LLM, SamplingParams
from kunlun_runtime.commands.cli import main

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Water boils at a temperature of",
    "The three primary colors are",
]


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


def test_greedy_fp32_is_token_identical_to_hf_on_five_prompts(smollm2_dir, reference):
    llm = LLM(str(smollm2_dir), dtype="float32", max_model_len=512, kv_cache_memory="256MiB")
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    for output in outputs:
        prompt = output.prompt_token_ids
        expected = reference.generate(
            torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
        assert output.outputs[0].token_ids == expected, output.prompt


def test_golden_cli_passes_on_the_embedded_model_and_prints_json(capsys):
    assert main(["golden", "--json", "--prompt", "Kunlun cards serve language models"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is True and report["first_divergent_layer"] is None
    assert [layer["name"] for layer in report["layers"]][:2] == ["embed_tokens", "layers.0"]
    assert len(report["layers"]) == 30 + 3
    assert all(layer["max_rel_err"] <= 1e-5 for layer in report["layers"])


def test_bf16_engine_agrees_with_fp32_reference_within_the_documented_bound(smollm2_dir):
    from kunlun_runtime.golden.runner import run_golden
    from kunlun_runtime.models.loader import load_model
    from kunlun_runtime.models.tokenizer import Tokenizer

    model, _ = load_model(smollm2_dir, torch.bfloat16, torch.device("cpu"), 256)
    token_ids = Tokenizer(smollm2_dir).encode(PROMPTS[2] + " there lived an old fisherman who")
    report = run_golden(model, smollm2_dir, token_ids)
    assert report.passed, [(layer.name, layer.max_rel_err) for layer in report.layers if not layer.passed]

"""Every architecture variant, layer by layer, against HF transformers in FP32 (tolerance 1e-5)."""

import pytest
import torch

from kunlun_runtime.golden.runner import run_golden
from kunlun_runtime.models.loader import load_model
from tests.support.tiny_models import TINY_SPECS

# (prompt length, prefill chunk): 64 and 100 span several 16-token blocks; chunks exercise
# prefill continuing over KV written by an earlier step.
LENGTHS = [(1, None), (7, None), (64, 24), (100, 16)]


@pytest.mark.parametrize("name", sorted(TINY_SPECS))
def test_every_layer_matches_hf_fp32(tiny_model_dirs, name):
    model, _ = load_model(tiny_model_dirs[name], torch.float32, torch.device("cpu"), 512)
    for length, chunk in LENGTHS:
        token_ids = [(7 * i + 3) % 300 for i in range(length)]
        report = run_golden(model, tiny_model_dirs[name], token_ids, chunk_size=chunk)
        assert report.passed, (length, [(layer.name, layer.max_rel_err) for layer in report.layers])
        assert [layer.name for layer in report.layers] == [
            "embed_tokens",
            "layers.0",
            "layers.1",
            "norm",
            "logits",
        ]
        assert max(layer.max_rel_err for layer in report.layers) <= 1e-5


def test_golden_names_the_first_layer_that_diverges(tiny_model_dirs):
    model, _ = load_model(tiny_model_dirs["llama-gqa"], torch.float32, torch.device("cpu"), 512)
    with torch.no_grad():
        model.layers[1].mlp.down_proj.weight[0, 0] += 1e-3  # a small injected error in layer 1
    report = run_golden(model, tiny_model_dirs["llama-gqa"], list(range(3, 40)))
    assert not report.passed
    assert report.first_divergent_layer == "layers.1"
    assert [layer.passed for layer in report.layers] == [True, True, False, False, False]


def test_bf16_stays_within_its_documented_bound(tiny_model_dirs):
    for name in ("llama-gqa", "qwen3-qknorm"):
        model, _ = load_model(tiny_model_dirs[name], torch.bfloat16, torch.device("cpu"), 512)
        report = run_golden(model, tiny_model_dirs[name], list(range(3, 67)))
        assert report.passed and report.layers[0].tolerance == 0.1
        assert report.layers[-1].max_rel_err > 1e-4  # it really ran in bf16

"""LoRA adapters against HF + PEFT in FP32, layer by layer; mixed batches; TP, INT8 and BF16 bases.

Adapters are made by ``peft`` on the tiny hidden-shape models (random non-zero A and B, every
projection or a subset, rsLoRA, per-module alphas) and on the embedded model.
"""

import pytest
import torch

from kunlun_runtime import LLM, LoRARequest, SamplingParams
from kunlun_runtime.golden.runner import capture_engine, report_against_reference, run_golden
from kunlun_runtime.lora.checkpoint import read_adapter
from kunlun_runtime.lora.slots import enable_lora_slots, install_adapter
from kunlun_runtime.models.loader import load_model
from tests.support.lora_adapters import make_adapter

ADAPTERS = {  # name → peft options
    "all-r8": {"rank": 8, "alpha": 16},
    "attn-r4-rslora": {"rank": 4, "alpha": 8, "targets": ("q_proj", "v_proj"), "use_rslora": True},
    "mlp-r16-pattern": {
        "rank": 16,
        "alpha": 32,
        "targets": ("gate_proj", "up_proj", "down_proj", "o_proj"),
        "alpha_pattern": {"down_proj": 4},
    },
    "per-layer-alphas": {  # PEFT's pattern rule: a whole module name, or a regex over it
        "rank": 8,
        "alpha": 16,
        "alpha_pattern": {"model.layers.0.self_attn.q_proj": 2, r"layers\.1\.mlp\.(gate|up)_proj": 64},
    },
}


@pytest.fixture(scope="module")
def adapters(tiny_model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    made = {}
    for model in ("llama-gqa", "qwen2-bias", "qwen3-qknorm"):
        for index, (name, options) in enumerate(ADAPTERS.items()):
            made[model, name] = make_adapter(
                tiny_model_dirs[model], root / model / name, seed=index + 1, **options
            )
    return made


@pytest.mark.parametrize("model_name", ["llama-gqa", "qwen2-bias", "qwen3-qknorm"])
@pytest.mark.parametrize("adapter_name", sorted(ADAPTERS))
def test_every_layer_with_an_adapter_matches_hf_peft_fp32(
    tiny_model_dirs, adapters, model_name, adapter_name
):
    model_dir, adapter_dir = tiny_model_dirs[model_name], adapters[model_name, adapter_name]
    model, config = load_model(model_dir, torch.float32, torch.device("cpu"), 512)
    enable_lora_slots(model, max_loras=2, max_rank=16)
    adapter = read_adapter(LoRARequest(adapter_name, 1, str(adapter_dir)), config, max_lora_rank=16)
    install_adapter(model, 1, adapter)  # slot 1: slot 0 stays empty, so the slot really is picked
    for length, chunk in [(7, None), (64, 24)]:
        token_ids = [(7 * i + 3) % 300 for i in range(length)]
        report = run_golden(model, model_dir, token_ids, chunk_size=chunk, lora=(1, adapter_dir))
        assert report.passed, (length, [(layer.name, layer.max_rel_err) for layer in report.layers])
        # The adapter really changes the first layer: the base model is far off the reference.
        base = capture_engine(model, token_ids, chunk_size=chunk)
        off = report_against_reference(base, model_dir, token_ids, torch.float32, 2, adapter_dir=adapter_dir)
        assert not off.passed and off.first_divergent_layer == "layers.0"


def test_the_embedded_model_with_an_adapter_matches_hf_peft(smollm2_dir, tmp_path):
    adapter_dir = make_adapter(smollm2_dir, tmp_path / "smol", rank=8, alpha=16, scale=0.05)
    model, config = load_model(smollm2_dir, torch.float32, torch.device("cpu"), 512)
    enable_lora_slots(model, max_loras=1, max_rank=8)
    install_adapter(model, 0, read_adapter(LoRARequest("smol", 1, str(adapter_dir)), config, 8))
    report = run_golden(model, smollm2_dir, list(range(100, 140)), lora=(0, adapter_dir))
    assert report.passed, [(layer.name, layer.max_rel_err) for layer in report.layers]


def _greedy(llm, prompts, loras, max_tokens=8):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras)
    return [o.outputs[0].token_ids for o in outputs]


PROMPTS = [[(11 * i + 5 * k) % 290 + 3 for i in range(9 + 5 * k)] for k in range(8)]


def _requests(tiny_model_dirs, adapters, model="llama-gqa"):
    return [
        LoRARequest(name, index + 1, str(adapters[model, name]))
        for index, name in enumerate(sorted(ADAPTERS))
    ]


@pytest.mark.parametrize("max_loras", [1, 3])
def test_a_mixed_batch_gives_each_request_the_tokens_it_gets_alone(tiny_model_dirs, adapters, max_loras):
    """Three adapters and the base in one batch (or, with one slot, in turns) as alone (no prefix
    cache: the runs alone compute their prompts again)."""
    loras = _requests(tiny_model_dirs, adapters)[:3]
    assignment = [loras[k % 3] if k % 4 != 3 else None for k in range(len(PROMPTS))]
    llm = LLM(
        str(tiny_model_dirs["llama-gqa"]),
        dtype="float32",
        enable_lora=True,
        max_loras=max_loras,
        max_model_len=128,
        enable_prefix_caching=False,
    )
    together = _greedy(llm, PROMPTS, assignment)
    alone = [_greedy(llm, [p], [lora])[0] for p, lora in zip(PROMPTS, assignment, strict=True)]
    assert together == alone
    assert len({tuple(t) for t in together}) == len(PROMPTS)  # adapters really differ
    assert llm.engine.block_pool.num_free == llm.engine.block_pool.num_blocks


def test_adapters_on_hidden_shapes_generate_what_peft_generates(tiny_model_dirs, adapters):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dirs["qwen3-qknorm"]
    llm = LLM(str(model_dir), dtype="float32", enable_lora=True, max_loras=3, max_model_len=128)
    loras = _requests(tiny_model_dirs, adapters, "qwen3-qknorm")[:3]
    ours = _greedy(llm, PROMPTS[:3], loras, max_tokens=6)
    for prompt, lora, tokens in zip(PROMPTS[:3], loras, ours, strict=True):
        reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        reference = PeftModel.from_pretrained(reference, lora.lora_path).eval()
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([prompt]), max_new_tokens=6, do_sample=False, min_new_tokens=6
            )
        assert tokens == out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_parallel_adapters_match_one_rank(tiny_model_dirs, adapters, layout):
    """Tensor parallelism shards A and B as the base weights; pipeline stages install their own
    layers' share; each step's micro-batches carry their sequences' slots."""
    loras = _requests(tiny_model_dirs, adapters)
    assignment = [loras[0], loras[1], None, loras[2]]
    options = {"dtype": "float32", "enable_lora": True, "max_loras": 3, "max_model_len": 128}
    one = _greedy(LLM(str(tiny_model_dirs["llama-gqa"]), **options), PROMPTS[:4], assignment)
    with LLM(str(tiny_model_dirs["llama-gqa"]), **layout, **options) as two_ranks:
        assert _greedy(two_ranks, PROMPTS[:4], assignment) == one


@pytest.mark.parametrize(
    ("dtype", "quantization"), [("bfloat16", None), ("bfloat16", "int8"), ("float32", "int8")]
)
def test_bf16_and_int8_bases_serve_adapters_close_to_fp32(tiny_model_dirs, adapters, dtype, quantization):
    """Lower-precision bases: the adapter's update still lands (tokens differ from the same base
    without it) and the first tokens agree with FP32 (the tiny models' logits are well apart)."""
    lora = _requests(tiny_model_dirs, adapters)[0]
    reference = _greedy(
        LLM(str(tiny_model_dirs["llama-gqa"]), dtype="float32", enable_lora=True, max_model_len=128),
        PROMPTS[:2],
        lora,
        max_tokens=3,
    )
    llm = LLM(
        str(tiny_model_dirs["llama-gqa"]),
        dtype=dtype,
        quantization=quantization,
        enable_lora=True,
        max_model_len=128,
    )
    with_adapter = _greedy(llm, PROMPTS[:2], lora, max_tokens=3)
    without = _greedy(llm, PROMPTS[:2], None, max_tokens=3)
    assert with_adapter != without
    assert [t[0] for t in with_adapter] == [t[0] for t in reference]

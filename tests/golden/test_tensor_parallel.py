"""Tensor parallelism on CPU (gloo): TP=2 in FP32 equals TP=1 layer by layer (1e-5) and in tokens."""

import json

import pytest
import torch

from kunlun_runtime import LLM, SamplingParams
from kunlun_runtime.commands.cli import main
from kunlun_runtime.errors import ConfigError
from kunlun_runtime.golden.ranks import capture_tensor_parallel
from kunlun_runtime.golden.runner import capture_engine, compare, layer_names
from kunlun_runtime.models.loader import load_model
from kunlun_runtime.parallel.group import free_port
from kunlun_runtime.parallel.layout import ParallelLayout
from kunlun_runtime.parallel.workers import LeaderGroup, RankSpec
from kunlun_runtime.platforms import CpuPlatform

TOKENS = [(13 * i + 5) % 300 for i in range(40)]


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-bias"])
def test_tp2_layer_outputs_equal_tp1_within_1e5(tiny_model_dirs, name):
    model_dir = tiny_model_dirs[name]
    model, config = load_model(model_dir, torch.float32, torch.device("cpu"), 64)
    single = capture_engine(model, TOKENS)
    split = capture_tensor_parallel(model_dir, TOKENS, world=2)
    rows = compare(split, single, layer_names(config.num_layers), tolerance=1e-5)
    assert all(row.passed for row in rows), [(row.name, row.max_rel_err) for row in rows]
    assert max(row.max_abs_err for row in rows) > 0  # really a different computation


def test_golden_command_runs_tp2_against_hf_fp32(tiny_model_dirs, capsys):
    """``kunlun-runtime golden --tensor-parallel-size 2``: the split engine against HF FP32 itself."""
    argv = ["golden", "--model", str(tiny_model_dirs["llama-gqa"]), "--tensor-parallel-size", "2", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["tensor_parallel_size"] == 2
    assert [layer["name"] for layer in report["layers"]] == layer_names(2)
    assert all(layer["max_rel_err"] <= 1e-5 for layer in report["layers"])


def test_tp2_engine_generates_the_same_tokens_and_logprobs(tiny_model_dirs):
    model_dir = str(tiny_model_dirs["llama-gqa"])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": [5, 17, 99, 3]}, {"prompt_token_ids": TOKENS}]
    single = LLM(model_dir, dtype="float32", kv_cache_memory="8MiB").generate(prompts, params)
    llm = LLM(model_dir, dtype="float32", kv_cache_memory="8MiB", tensor_parallel_size=2)
    try:
        split = llm.generate(prompts, params)
    finally:
        llm.engine.close()
    for one, two in zip(single, split, strict=True):
        assert one.outputs[0].token_ids == two.outputs[0].token_ids
        tokens = one.outputs[0].token_ids
        got = [position[t].logprob for position, t in zip(two.outputs[0].logprobs, tokens, strict=True)]
        want = [position[t].logprob for position, t in zip(one.outputs[0].logprobs, tokens, strict=True)]
        assert got == pytest.approx(want, abs=1e-5)


def test_tensor_parallel_size_that_does_not_divide_the_heads_is_refused(tiny_model_dirs):
    with pytest.raises(
        ConfigError, match=r"tensor_parallel_size: 3 does not divide the model's num_attention_heads \(4\)"
    ):
        LLM(str(tiny_model_dirs["llama-gqa"]), dtype="float32", tensor_parallel_size=3)


class BindingPlatform(CpuPlatform):
    """The CPU platform with per-rank devices, as an accelerator's: ``set_device(r)`` binds device r
    (pickled to the worker processes like the engine's platform; defined at module level for that)."""

    def __init__(self) -> None:
        super().__init__()
        self.bound: int | None = None

    def set_device(self, local_rank: int) -> None:
        self.bound = local_rank

    def current_device_index(self) -> int | None:
        return self.bound


def test_tp2_ranks_each_bind_their_own_device_and_the_preflight_sees_it(tiny_model_dirs):
    """Rank 0 here and rank 1 in its worker process each bind their device; the collective preflight
    gathers [0, 1] (a rank that had not bound its own would fail it, naming the rank)."""
    platform = BindingPlatform()
    spec = RankSpec(
        model_dir=str(tiny_model_dirs["llama-gqa"]),
        dtype=torch.float32,
        weight_dtype=torch.float32,
        max_positions=64,
        num_blocks=8,
        block_size=16,
        cache_line_bytes=64,
        cache_num_sets=4096,
        kv_block_skew=False,
        linear_backend="plain",
        quantization=None,
        fused_attention=False,
        native_kernels=False,
        layout=ParallelLayout(tensor=2),
        stages=(range(2),),
        backend="gloo",
        master_addr="127.0.0.1",
        master_port=free_port(),
        platform=platform,
        vocab_size=320,
        hidden_size=64,
    )
    group = LeaderGroup(spec)
    try:
        group.start()
        assert platform.bound == 0
    finally:
        group.close()

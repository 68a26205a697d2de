"""Pipeline parallelism on CPU (gloo, one process per rank, over loopback): P=2 and P=2 × T=2 in
FP32 equal P=1 layer by layer (1e-5), and the engine's greedy tokens and logprobs are identical."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kunlun_runtime import LLM, SamplingParams
from kunlun_runtime.commands.cli import main
from kunlun_runtime.errors import ConfigError, EngineDeadError
from kunlun_runtime.golden.ranks import capture_parallel
from kunlun_runtime.golden.runner import capture_engine, compare, layer_names
from kunlun_runtime.models.loader import load_model
from kunlun_runtime.parallel.pipeline import MIN_MICRO_BATCH_TOKENS
from tests.support.tiny_models import TINY_SPECS, make_tiny_model

TOKENS = [(13 * i + 5) % 300 for i in range(40)]
NUM_LAYERS = 4


@pytest.fixture(scope="module")
def deep_models(tmp_path_factory):
    """Tiny models with four layers (two per stage): untied and tied (the last stage then holds
    its own copy of the embedding as ``lm_head``)."""
    root = tmp_path_factory.mktemp("deep")
    return {
        name: make_tiny_model(root / name, replace(TINY_SPECS[name], num_layers=NUM_LAYERS))
        for name in ("llama-gqa", "qwen2-bias")
    }


@pytest.mark.parametrize(
    ("name", "tensor", "pipeline"),
    [("llama-gqa", 1, 2), ("llama-gqa", 2, 2), ("qwen2-bias", 1, 2)],  # Qwen2: biases, tied lm_head
)
def test_pipeline_layer_outputs_equal_one_rank_within_1e5(deep_models, name, tensor, pipeline):
    model_dir = deep_models[name]
    model, config = load_model(model_dir, torch.float32, torch.device("cpu"), 64)
    single = capture_engine(model, TOKENS)
    split = capture_parallel(model_dir, TOKENS, tensor=tensor, pipeline=pipeline)
    names = layer_names(config.num_layers)
    assert sorted(split) == sorted(names)  # every layer came back from the stage that holds it
    rows = compare(split, single, names, tolerance=1e-5)
    assert all(row.passed for row in rows), [(row.name, row.max_rel_err) for row in rows]
    if tensor == 1:  # the same arithmetic in another process: bit for bit
        assert all(row.max_abs_err == 0 for row in rows)


def test_golden_command_runs_pipeline_stages_against_hf_fp32(deep_models, capsys):
    """``kunlun-runtime golden --pipeline-parallel-size 2``: the staged engine against HF FP32."""
    argv = ["golden", "--model", str(deep_models["llama-gqa"]), "--pipeline-parallel-size", "2", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["pipeline_parallel_size"] == 2
    assert [layer["name"] for layer in report["layers"]] == layer_names(NUM_LAYERS)
    assert all(layer["max_rel_err"] <= 1e-5 for layer in report["layers"])


@pytest.mark.parametrize(("tensor", "pipeline"), [(1, 2), (2, 2)])
def test_pipeline_engine_generates_the_same_tokens_and_logprobs(deep_models, tensor, pipeline):
    """Enough sequences at once (``MIN_MICRO_BATCH_TOKENS`` per micro-batch) that decode steps
    split into micro-batches in flight across the stages; one with prompt logprobs (rows of a
    prefill chunk come back with the sampled rows)."""
    model_dir = str(deep_models["llama-gqa"])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    short = [{"prompt_token_ids": [5 + i, 17, 99, 3 * i]} for i in range(2 * MIN_MICRO_BATCH_TOKENS)]
    prompts = [*short, {"prompt_token_ids": TOKENS}, {"prompt_token_ids": [7]}]
    with_prompt = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    single_llm = LLM(model_dir, dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=16)
    single = single_llm.generate(prompts, params)
    single_prompt = single_llm.generate([{"prompt_token_ids": TOKENS}], with_prompt)[0]
    llm = LLM(
        model_dir,
        dtype="float32",
        kv_cache_memory="8MiB",
        max_num_batched_tokens=16,  # the long prompt is prefilled in chunks beside running decodes
        tensor_parallel_size=tensor,
        pipeline_parallel_size=pipeline,
    )
    plans: list[int] = []
    execute = llm.engine.group.execute if llm.engine.group is not None else None
    assert execute is not None

    def counting(plan):
        plans.append(len(plan.micro_batches))
        return execute(plan)

    llm.engine.group.execute = counting  # type: ignore[method-assign]
    try:
        assert llm.engine.runner.micro_batches == pipeline
        assert llm.engine.model.first_layer == 0 and len(llm.engine.model.layers) == NUM_LAYERS // pipeline
        split = llm.generate(prompts, params)
        split_prompt = llm.generate([{"prompt_token_ids": TOKENS}], with_prompt)[0]
    finally:
        llm.engine.close()
    assert max(plans) == pipeline  # steps did run as micro-batches in flight together
    for one, two in zip(single, split, strict=True):
        assert one.outputs[0].token_ids == two.outputs[0].token_ids
        tokens = one.outputs[0].token_ids
        got = [position[t].logprob for position, t in zip(two.outputs[0].logprobs, tokens, strict=True)]
        want = [position[t].logprob for position, t in zip(one.outputs[0].logprobs, tokens, strict=True)]
        assert got == pytest.approx(want, abs=1e-5)
    assert split_prompt.outputs[0].token_ids == single_prompt.outputs[0].token_ids
    got = [next(iter(p.values())).logprob for p in split_prompt.prompt_logprobs[1:]]
    want = [next(iter(p.values())).logprob for p in single_prompt.prompt_logprobs[1:]]
    assert got == pytest.approx(want, abs=1e-5)


def test_each_stage_holds_the_kv_of_its_own_layers_only(deep_models):
    """The KV budget is per card: a stage of half the layers fits twice the blocks."""
    model_dir = str(deep_models["llama-gqa"])
    single = LLM(model_dir, dtype="float32", kv_cache_memory="4MiB")
    staged = LLM(model_dir, dtype="float32", kv_cache_memory="4MiB", pipeline_parallel_size=2)
    try:
        assert staged.engine.kv_cache.spec.num_layers == NUM_LAYERS // 2
        assert staged.engine.block_pool.num_blocks >= 2 * single.engine.block_pool.num_blocks - 1
    finally:
        staged.engine.close()


def test_more_stages_than_layers_is_refused_naming_the_option(deep_models):
    with pytest.raises(ConfigError, match="pipeline_parallel_size: 5 stages need at least that many layers"):
        LLM(str(deep_models["llama-gqa"]), dtype="float32", pipeline_parallel_size=5)


def test_a_rank_that_fails_to_load_fails_the_start_naming_it(tmp_path, deep_models):
    """Stage 1 cannot find its layers' weights (a checkpoint truncated after layer 1): the leader,
    which loaded fine, refuses to start and names rank 1, its node and the missing weights."""
    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / "truncated"
    model_dir.mkdir()
    source = deep_models["llama-gqa"]
    for path in source.iterdir():
        if path.suffix != ".safetensors":
            (model_dir / path.name).write_bytes(path.read_bytes())
    for path in source.glob("*.safetensors"):
        tensors = load_file(path)
        kept = {name: t for name, t in tensors.items() if ".layers.3." not in name}
        save_file(kept, model_dir / path.name)
    with pytest.raises(EngineDeadError) as failure:
        capture_parallel(model_dir, TOKENS[:8], tensor=1, pipeline=2)
    message = str(failure.value)
    assert "rank 1 of 2 (node 0, host" in message and "failed to start" in message
    assert "missing weights ['layers.1." in message  # the stage's own numbering of layer 3


WORKER_NODE_MAIN = """
import socket
import sys
import torch
from kunlun_runtime.parallel.layout import ParallelLayout
from kunlun_runtime.parallel.workers import RankSpec, run_worker_node
from tests.support.failing_platform import FailingBindPlatform

if __name__ == "__main__":
    # A "leader" whose port accepts connections but never forms the group: the node gets past its
    # wait for the leader, and its join then waits for a group that never comes.
    leader = socket.create_server(("127.0.0.1", 0))
    layout = ParallelLayout(tensor=2, pipeline=2, nnodes=2, node_rank=1).validate()
    spec = RankSpec(
        sys.argv[1], torch.float32, torch.float32, 64, 8, 16, 64, 64, True, "plain", None, True, False,
        layout, (range(2), range(2, 4)), "gloo", "127.0.0.1", leader.getsockname()[1], FailingBindPlatform(1),
        vocab_size=320, hidden_size=64,
    )
    sys.exit(run_worker_node(spec))
"""


def test_a_node_whose_local_rank_cannot_start_exits_1_at_once(deep_models, tmp_path):
    """Node 1's second rank cannot bind its card: the node's process names the rank and exits 1
    while its own join is still waiting for the leader (which never comes), instead of waiting
    out the 30-minute startup timeout."""
    script = tmp_path / "worker_node.py"
    script.write_text(WORKER_NODE_MAIN)
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, str(script), str(deep_models["llama-gqa"])],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert "rank-3 (node 1, backend gloo) exited with code 1 while the group was starting" in done.stderr


def test_bf16_stages_send_their_logits_in_bf16_and_equal_one_rank(deep_models):
    """BF16 activations: the last stage sends lm_head's BF16 output (half the bytes of FP32, the
    precision the logits have anyway) and the leader widens it: the same logits as one rank."""
    model_dir = deep_models["llama-gqa"]
    model, config = load_model(model_dir, torch.bfloat16, torch.device("cpu"), 64)
    single = capture_engine(model, TOKENS)
    split = capture_parallel(model_dir, TOKENS, tensor=1, pipeline=2, dtype=torch.bfloat16)
    rows = compare(split, single, layer_names(config.num_layers), tolerance=1e-5)
    assert all(row.max_abs_err == 0 for row in rows), [(row.name, row.max_abs_err) for row in rows]

"""Where ranks sit, how layers split into stages and a step into micro-batches, and where the node
flags come from (pure functions: no process group)."""

from __future__ import annotations

import argparse
import itertools
from dataclasses import replace

import pytest

from kunlun_runtime.config import EngineConfig
from kunlun_runtime.errors import ConfigError
from kunlun_runtime.layers.rotary import RopeConfig
from kunlun_runtime.models.forward import StepInputs
from kunlun_runtime.models.model_config import ModelConfig
from kunlun_runtime.options.flags import add_engine_args, engine_config_from_args, rendezvous_options
from kunlun_runtime.parallel.layout import ParallelLayout, layer_bytes, split_layers, stage_layers
from kunlun_runtime.parallel.pipeline import MIN_MICRO_BATCH_TOKENS, plan_step


def test_tensor_ranks_of_a_stage_share_a_node_and_stages_cross_nodes() -> None:
    layout = ParallelLayout(tensor=4, pipeline=2, nnodes=2, node_rank=1).validate()
    assert layout.world == 8 and layout.ranks_per_node == 4
    assert list(layout.node_ranks) == [4, 5, 6, 7]
    assert [layout.stage_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [layout.node_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [layout.local_rank_of(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [layout.next_rank(r) for r in range(4)] == [4, 5, 6, 7]
    assert layout.last_stage_leader == 4
    one_node = ParallelLayout(tensor=2, pipeline=2).validate()  # every rank on one machine
    assert list(one_node.node_ranks) == [0, 1, 2, 3]
    assert [one_node.local_rank_of(r) for r in range(4)] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("layout", "field", "words"),
    [
        (ParallelLayout(tensor=2, pipeline=2, nnodes=4), "nnodes", "split a stage"),
        (ParallelLayout(tensor=1, pipeline=3, nnodes=2), "nnodes", "evenly"),
        (ParallelLayout(pipeline=2, nnodes=2, node_rank=2), "node_rank", "[0, 2)"),
        (ParallelLayout(pipeline=0), "pipeline_parallel_size", ">= 1"),
    ],
)
def test_a_layout_that_cannot_be_laid_out_names_the_option(layout, field, words) -> None:
    with pytest.raises(ConfigError) as failure:
        layout.validate()
    assert failure.value.field == field and words in str(failure.value)


def test_layers_split_into_contiguous_stages_minimising_the_largest() -> None:
    assert split_layers([1] * 8, 2) == [range(0, 4), range(4, 8)]
    # the embedding (3 layers' worth) on the first stage, the head (3) on the last
    assert split_layers([1] * 10, 2, first_extra=3, last_extra=3) == [range(0, 5), range(5, 10)]
    # 5 + 2 | 8 and 5 + 3 | 7 are both best: the later stage takes the larger share
    assert split_layers([1] * 10, 2, first_extra=5) == [range(0, 2), range(2, 10)]
    # uneven: the largest stage is as small as it can be; later stages take the rest of a tie
    split = split_layers([1] * 7, 3)
    assert split == [range(0, 1), range(1, 4), range(4, 7)]
    assert all(a.stop == b.start for a, b in itertools.pairwise(split_layers([2, 1, 3, 1, 2, 2, 1], 4)))
    assert split_layers([5, 1, 1, 1, 1, 1], 2) == [range(0, 1), range(1, 6)]
    with pytest.raises(ConfigError, match="pipeline_parallel_size: 3 stages need at least that many layers"):
        split_layers([1, 1], 3)


def test_stage_layers_count_the_embedding_and_head_with_the_end_stages() -> None:
    config = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope=RopeConfig(theta=100000.0),
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        attention_bias=False,
        qk_norm=False,
        sliding_window=None,
        bos_token_id=None,
        eos_token_ids=(2,),
    )
    layer, embedding, head = layer_bytes(config)
    assert layer == 2 * (576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536 + 2 * 576)
    assert embedding == 2 * 49152 * 576 and head == embedding + 2 * 576
    stages = stage_layers(config, 2)
    assert stages == [range(0, 15), range(15, 30)]  # the embedding and the head weigh alike
    sizes = [len(stage) * layer + extra for stage, extra in zip(stages, (embedding, head), strict=True)]
    assert max(sizes) - min(sizes) <= layer + 2 * 576 * 2


def _inputs(lengths: list[int]) -> StepInputs:
    inputs = StepInputs()
    for index, length in enumerate(lengths):
        inputs.token_ids.extend(range(100 * index, 100 * index + length))
        inputs.positions.extend(range(length))
        inputs.query_lens.append(length)
        inputs.context_lens.append(length)
        inputs.block_tables.append([index])
    return inputs


def test_a_step_splits_into_micro_batches_of_whole_sequences_and_the_rows_come_back_in_order() -> None:
    inputs = _inputs([2, 2, 2, 2, 8])  # four sequences of 2 tokens and a prefill chunk of 8: 16 tokens
    wanted = [15, 0, 8, 2]  # rows of the step (over all its tokens), in the order the leader wants
    plan, order = plan_step(inputs, wanted, 2)
    assert [mb.query_lens for mb in plan.micro_batches] == [[2, 2, 2, 2], [8]]
    assert plan.micro_batches[0].token_ids == [0, 1, 100, 101, 200, 201, 300, 301]
    assert plan.micro_batches[1].token_ids == list(range(400, 408))
    assert plan.micro_batches[1].positions == list(range(8))
    assert [mb.block_tables for mb in plan.micro_batches] == [[[0], [1], [2], [3]], [[4]]]
    assert plan.logit_rows == [[0, 2], [7, 0]]  # each micro-batch's own rows
    # the micro-batches' logits concatenated hold step rows 0, 2, 15, 8; order picks them as wanted
    concatenated = [0, 2, 8 + 7, 8 + 0]
    assert [concatenated[i] for i in order] == wanted
    single, identity = plan_step(inputs, wanted, 1)
    assert single.micro_batches == [inputs] and identity == list(range(len(wanted)))
    lone, _ = plan_step(_inputs([16]), [15], 4)  # one sequence: nothing to split
    assert len(lone.micro_batches) == 1


def test_a_step_too_small_to_pay_for_a_split_stays_whole() -> None:
    """Every micro-batch reads the stage's weights again: below MIN_MICRO_BATCH_TOKENS tokens per
    micro-batch the step runs whole."""
    small = _inputs([1] * (2 * MIN_MICRO_BATCH_TOKENS - 1))
    assert len(plan_step(small, [0], 2)[0].micro_batches) == 1
    enough = _inputs([1] * (2 * MIN_MICRO_BATCH_TOKENS))
    assert [len(mb.query_lens) for mb in plan_step(enough, [0], 2)[0].micro_batches] == [
        MIN_MICRO_BATCH_TOKENS,
        MIN_MICRO_BATCH_TOKENS,
    ]
    assert len(plan_step(_inputs([1] * 3 * MIN_MICRO_BATCH_TOKENS), [0], 4)[0].micro_batches) == 3


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(argv)


def test_node_flags_come_from_leaderworkerset_env_unless_given() -> None:
    env = {"LWS_LEADER_ADDRESS": "svc-0.svc.ns", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1"}
    assert rendezvous_options(_parse([]), env) == {
        "nnodes": 2,
        "node_rank": 1,
        "master_addr": "svc-0.svc.ns",
        "master_port": None,
    }
    given = _parse(
        ["--nnodes", "1", "--node-rank", "0", "--master-addr", "10.0.0.1", "--master-port", "29600"]
    )
    assert rendezvous_options(given, env) == {
        "nnodes": 1,
        "node_rank": 0,
        "master_addr": "10.0.0.1",
        "master_port": 29600,
    }
    assert rendezvous_options(_parse([]), {}) == {
        "nnodes": 1,
        "node_rank": 0,
        "master_addr": "127.0.0.1",
        "master_port": None,
    }
    with pytest.raises(ConfigError, match="LWS_GROUP_SIZE: must be an integer, got 'two'"):
        rendezvous_options(_parse([]), {"LWS_GROUP_SIZE": "two"})


def test_pipeline_flags_reach_the_engine_config(monkeypatch) -> None:
    monkeypatch.delenv("LWS_GROUP_SIZE", raising=False)
    monkeypatch.delenv("LWS_WORKER_INDEX", raising=False)
    monkeypatch.delenv("LWS_LEADER_ADDRESS", raising=False)
    argv = [
        "--pipeline-parallel-size",
        "2",
        "--tensor-parallel-size",
        "2",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        "10.0.0.1",
    ]
    config = engine_config_from_args(_parse([*argv, "--distributed-timeout", "5"]))
    assert (config.pipeline_parallel_size, config.tensor_parallel_size) == (2, 2)
    assert (config.nnodes, config.node_rank, config.distributed_timeout_seconds) == (2, 1, 5.0)
    assert config.master_addr == "10.0.0.1"


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["--nnodes", "2"], {}),
        ([], {"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1"}),
    ],
    ids=["flag", "leaderworkerset env without its leader address"],
)
def test_several_nodes_without_the_leader_address_is_a_start_error_naming_the_flags(
    argv, env, monkeypatch
) -> None:
    for variable in ("LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"):
        monkeypatch.delenv(variable, raising=False)
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as failure:
        engine_config_from_args(_parse(argv))
    assert failure.value.field == "master_addr"
    assert str(failure.value) == (
        "master_addr: --nnodes 2 (or $LWS_GROUP_SIZE) needs the leader's address: give --master-addr HOST "
        "(node 0's address, reachable from every node) or run under LeaderWorkerSet, which sets "
        "$LWS_LEADER_ADDRESS"
    )


def test_a_config_file_that_makes_several_nodes_needs_the_leader_address_too(tmp_path, monkeypatch) -> None:
    for variable in ("LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"):
        monkeypatch.delenv(variable, raising=False)
    file = tmp_path / "engine.yaml"
    file.write_text("pipeline_parallel_size: 2\nnnodes: 2\n")
    with pytest.raises(ConfigError, match=r"--nnodes 2 .* needs the leader's address"):
        engine_config_from_args(_parse(["--config", str(file)]))
    config = engine_config_from_args(_parse(["--config", str(file), "--master-addr", "10.0.0.1"]))
    assert (config.nnodes, config.master_addr) == (2, "10.0.0.1")
    file.write_text("pipeline_parallel_size: 2\nnnodes: 2\nmaster_addr: 10.0.0.2\n")
    assert engine_config_from_args(_parse(["--config", str(file)])).master_addr == "10.0.0.2"
    # the nodes from the environment, the address from the file: a valid group
    file.write_text("pipeline_parallel_size: 2\nmaster_addr: 10.0.0.2\n")
    monkeypatch.setenv("LWS_GROUP_SIZE", "2")
    assert engine_config_from_args(_parse(["--config", str(file)])).master_addr == "10.0.0.2"


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"pipeline_parallel_size": 2, "nnodes": 3}, "nnodes"),
        ({"pipeline_parallel_size": 2, "nnodes": 2, "node_rank": 2}, "node_rank"),
        ({"distributed_timeout_seconds": 0.0}, "distributed_timeout"),
        ({"master_port": 70000}, "master_port"),
        ({"pipeline_parallel_size": 0}, "pipeline_parallel_size"),
    ],
)
def test_engine_config_names_a_bad_parallel_option(options, field) -> None:
    with pytest.raises(ConfigError) as failure:
        EngineConfig(**options).validate()
    assert failure.value.field == field


def test_a_split_that_would_leave_a_micro_batch_too_small_takes_fewer() -> None:
    plan, _ = plan_step(_inputs([15, 1]), [14, 15], 2)  # 15 | 1: the 1-token micro-batch is not worth it
    assert [mb.query_lens for mb in plan.micro_batches] == [[15, 1]]
    plan, _ = plan_step(_inputs([6, 6, 1]), [5, 11, 12], 3)  # three would leave 1 token: two
    assert [mb.query_lens for mb in plan.micro_batches] == [[6], [6, 1]]


def test_a_stage_reads_only_its_own_weights_and_a_stray_layer_is_still_refused(tmp_path, monkeypatch) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    from kunlun_runtime.errors import ModelLoadError
    from kunlun_runtime.models import loader
    from tests.support.tiny_models import TINY_SPECS, make_tiny_model

    model_dir = make_tiny_model(tmp_path / "deep", replace(TINY_SPECS["llama-gqa"], num_layers=4))
    read: list[str] = []
    original = loader.iter_weights

    def recording(directory, wanted=None):
        for name, tensor in original(directory, wanted):
            read.append(name)
            yield name, tensor

    monkeypatch.setattr(loader, "iter_weights", recording)
    model, _ = loader.load_model(model_dir, torch.float32, torch.device("cpu"), 64, layers=range(2, 4))
    layers_read = {int(name.split(".")[2]) for name in read if name.startswith("model.layers.")}
    assert layers_read == {2, 3}  # the first stage's layers were never read
    assert "lm_head.weight" in read and "model.norm.weight" in read
    assert model.embed_tokens is None and model.lm_head is not None and len(model.layers) == 2
    first, _ = loader.load_model(model_dir, torch.float32, torch.device("cpu"), 64, layers=range(0, 2))
    assert first.lm_head is None and first.norm is None and first.embed_tokens is not None
    monkeypatch.setattr(loader, "iter_weights", original)
    weights = next(model_dir.glob("*.safetensors"))
    tensors = load_file(weights)
    tensors["model.layers.7.input_layernorm.weight"] = tensors[
        "model.layers.0.input_layernorm.weight"
    ].clone()
    save_file(tensors, weights)
    for stage in (range(0, 2), range(2, 4)):
        with pytest.raises(ModelLoadError, match=r"unexpected weight 'layers\.7"):
            loader.load_model(model_dir, torch.float32, torch.device("cpu"), 64, layers=stage)


def test_a_worker_nodes_wait_for_the_leader_defaults_to_the_distributed_timeout_and_can_be_longer() -> None:
    argv = ["--pipeline-parallel-size", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1"]
    assert engine_config_from_args(_parse(argv)).leader_wait_timeout_seconds is None
    config = engine_config_from_args(_parse([*argv, "--leader-wait-timeout", "1800"]))
    assert config.leader_wait_timeout_seconds == 1800.0
    assert config.distributed_timeout_seconds == 60.0
    with pytest.raises(ConfigError, match=r"leader_wait_timeout: must be at least 1 second, got 0\.5"):
        engine_config_from_args(_parse([*argv, "--leader-wait-timeout", "0.5"]))

"""Tensor- and pipeline-parallel sizes from `tune`: the stage split, the bytes on one card, and the
recommendation on P800 nodes (8 cards of 96 GiB: 98304 MiB per card in `xpu_smi`), each with its
numbers. Model facts are built from the published shapes of Llama-family checkpoints."""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path

import pytest
import torch
import yaml

from kunlun_runtime.errors import ConfigError
from kunlun_runtime.options.config_file import load_engine_options
from kunlun_runtime.tuning import Measurements, Targets, TuningError, profiler, recommend
from kunlun_runtime.tuning import cli as tune_cli
from kunlun_runtime.tuning.facts import part_bytes
from kunlun_runtime.tuning.measurements import (
    DecodePoint,
    ModelFacts,
    ModelParts,
    PlatformFacts,
    PrefillPoint,
)
from kunlun_runtime.tuning.stages import Stage, boundary_bytes_per_step, plan_stages, split_layers

GIB, MIB = 1 << 30, 1 << 20
P800 = PlatformFacts("kunlun", 8, 96 * GIB, "device memory per card")


def make_model(
    name: str,
    num_layers: int,
    hidden: int,
    intermediate: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    max_model_len: int,
    linear_bytes: int = 2,  # 1: INT8 linear layers and lm_head (the embedding stays BF16)
) -> tuple[ModelFacts, ModelParts]:
    """A Llama-family model's facts and parts as the profiler records them (BF16 norms, embedding)."""
    head_dim = hidden // heads
    linear = (
        hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * intermediate
    )
    layer = linear * linear_bytes + 2 * hidden * 2
    embedding = vocab * hidden * 2
    head = vocab * hidden * linear_bytes + hidden * 2
    weights = num_layers * layer + embedding + head
    facts = ModelFacts(name, "bfloat16", num_layers, heads, kv_heads, head_dim, weights, max_model_len)
    return facts, ModelParts(hidden, intermediate, vocab, layer, embedding, head)


QWEN2_7B = make_model("Qwen2-7B", 28, 3584, 18944, 28, 4, 152064, 32768)
LLAMA_70B = make_model("Llama-3.1-70B", 80, 8192, 28672, 64, 8, 128256, 131072)
LLAMA_405B = make_model("Llama-3.1-405B", 126, 16384, 53248, 128, 8, 128256, 8192)


def make_measurements(
    model: tuple[ModelFacts, ModelParts | None], platform: PlatformFacts = P800
) -> Measurements:
    """One prefill point (300 MiB of activations) and one decode point of 128 sequences: enough
    for a recommendation; block sizes untimed (16, unpadded)."""
    return Measurements(
        platform=platform,
        model=model[0],
        prefill=(PrefillPoint(512, 0.032, 3, 300 * MIB),),
        decode=(DecodePoint(128, 64, 0.080, 3),),
        block_sizes=(),
        kv_block_bytes={},
        budget_seconds=60.0,
        elapsed_seconds=42.0,
        parts=model[1],
    )


def test_layers_split_by_bytes_with_the_ends_and_ties_to_later_stages() -> None:
    # 10 layers of 10 B, 25 B of embedding, 5 B of head: stages of 45, 40 and 45 B
    assert split_layers(10, 10, 25, 5, 3) == (2, 4, 4)
    assert split_layers(5, 1, 0, 0, 2) == (2, 3)  # a tie: the later stage takes the extra layer
    assert split_layers(126, 6_375_407_616, 4_202_692_608, 4_202_725_376, 2) == (63, 63)
    assert split_layers(126, 6_375_407_616, 4_202_692_608, 4_202_725_376, 4) == (31, 32, 32, 31)
    assert split_layers(3, 100, 1000, 0, 3) == (1, 1, 1)  # every stage keeps a layer
    with pytest.raises(ValueError, match="cannot split 2 layers into 3 stages"):
        split_layers(2, 1, 0, 0, 3)


def test_a_card_holds_its_share_of_the_layers_and_whole_ends() -> None:
    layer, embedding, head = 6_375_407_616, 4_202_692_608, 4_202_725_376
    block = 16 * 2 * 126 * 8 * 128 * 2  # one 16-token block of all layers' K and V on one card at TP 1
    assert plan_stages(*LLAMA_405B, block, 8, 2) == (
        Stage(63, 63 * layer // 8 + embedding, 16 * 2 * 63 * 1 * 128 * 2),
        Stage(63, 63 * layer // 8 + head, 16 * 2 * 63 * 1 * 128 * 2),
    )
    assert plan_stages(*LLAMA_405B, block, 8, 1) == (
        Stage(126, 126 * layer // 8 + embedding + head, block // 8),
    )


def test_a_tied_lm_head_is_counted_once_on_one_stage_and_copied_on_the_last() -> None:
    tied = ModelFacts("tied", "float32", 4, 4, 2, 8, 4 * 100 + 60 + 4, 64)  # lm_head is the embedding
    parts = ModelParts(
        hidden_size=4,
        intermediate_size=8,
        vocab_size=15,
        layer_bytes=100,
        embedding_bytes=60,
        head_bytes=4 + 60,
    )
    assert [s.weight_bytes for s in plan_stages(tied, parts, 1024, 1, 1)] == [4 * 100 + 64]
    assert [s.weight_bytes for s in plan_stages(tied, parts, 1024, 1, 2)] == [2 * 100 + 60, 2 * 100 + 64]


def test_unrecorded_parts_spread_the_weights_evenly() -> None:
    old = ModelFacts("old", "bfloat16", 5, 4, 2, 8, 1000, 64)  # a tune file from before the parts
    assert plan_stages(old, None, 100, 2, 2) == (Stage(2, 200, 20), Stage(3, 300, 30))
    assert boundary_bytes_per_step(old, None, 128) is None
    assert boundary_bytes_per_step(*LLAMA_405B, 128) == 128 * 16384 * 2


def test_seven_b_stays_on_one_card_of_one_node() -> None:
    result = recommend(make_measurements(QWEN2_7B))
    # one node: pipeline_parallel_size is left at the engine's default, 1, with no reason of its own
    assert (result.options["tensor_parallel_size"], "pipeline_parallel_size" in result.options) == (1, False)
    assert list(result.reasons) == list(result.options)
    assert result.reasons["tensor_parallel_size"] == (
        "smallest TP size (of [1, 2, 4]) at which a card holds its weights (14.18 GiB), activations "
        "(300.0 MiB) and one 32768-token sequence of KV (1.75 GiB) within 90% of 96.00 GiB (device memory "
        "per card); 8 card(s) here"
    )


def test_seventy_b_bf16_at_128k_context_fits_one_p800_node_at_tp_4() -> None:
    # TP 2 would need 63.75 GiB of layers + 3.91 GiB of replicated ends + 20 GiB of KV for one
    # 131072-token sequence (327680 B/token / 2) + activations: 87.96 GiB, over 86.40 GiB
    result = recommend(make_measurements(LLAMA_70B))
    assert result.options == {
        "dtype": "bfloat16",
        "max_model_len": 131072,
        "block_size": 16,
        "max_num_seqs": 128,
        "max_num_batched_tokens": 512,
        "kv_cache_memory_bytes": 54_026_829_824,
        "tensor_parallel_size": 4,
    }
    assert result.reasons["tensor_parallel_size"] == (
        "smallest TP size (of [1, 2, 4, 8]) at which a card holds its weights (35.79 GiB), activations "
        "(300.0 MiB) and one 131072-token sequence of KV (10.00 GiB) within 90% of 96.00 GiB (device memory "
        "per card); 8 card(s) here"
    )
    assert result.reasons["kv_cache_memory_bytes"] == (
        "min(room left on a card: 50.32 GiB, KV of max_num_seqs=128 sequences of max_model_len=131072: "
        "1280.00 GiB); holds 659504 tokens (5.0 full-length sequences) at 81920 B/token per card"
    )


def test_seventy_b_on_two_card_nodes_needs_two_nodes() -> None:
    result = recommend(make_measurements(LLAMA_70B), Targets(cards_per_node=2))
    assert (result.options["tensor_parallel_size"], result.options["pipeline_parallel_size"]) == (2, 2)
    assert result.reasons["tensor_parallel_size"] == (
        "the largest TP size (of [1, 2]) within 2 card(s) per node: even at TP 2 a card of one node would "
        "need weights 67.67 GiB + activations 300.0 MiB + one 131072-token sequence of KV (20.00 GiB) = "
        "87.96 GiB, over 90% of 96.00 GiB (device memory per card); so the layers are split over nodes"
    )


def test_four_hundred_b_bf16_needs_two_p800_nodes_and_names_the_boundary_cost() -> None:
    result = recommend(make_measurements(LLAMA_405B), Targets(stage_boundary_seconds=0.0005))
    assert result.options == {
        "dtype": "bfloat16",
        "max_model_len": 8192,
        "block_size": 16,
        "max_num_seqs": 128,
        "max_num_batched_tokens": 512,
        "kv_cache_memory_bytes": 128 * 8192 * 32256,  # all 128 sequences: room is 35.43 GiB
        "tensor_parallel_size": 8,
        "pipeline_parallel_size": 2,
    }
    assert result.reasons["tensor_parallel_size"] == (
        "the largest TP size (of [1, 2, 4, 8]) within 8 card(s) here: even at TP 8 a card of one node would "
        "need weights 101.34 GiB + activations 300.0 MiB + one 8192-token sequence of KV (504.0 MiB) = "
        "102.13 GiB, over 90% of 96.00 GiB (device memory per card); so the layers are split over nodes"
    )
    assert result.reasons["pipeline_parallel_size"] == (
        "smallest number of nodes (of up to 16) at which every card fits: 2 nodes × 8 cards = 16 cards, "
        "layers per stage [63, 63] (embedding on the first, norm and lm_head on the last); the fullest card "
        "(stage 1) holds weights 50.67 GiB + activations 300.0 MiB + one 8192-token sequence of KV "
        "(252.0 MiB) = 51.21 GiB of its 86.40 GiB budget, against 102.13 GiB on one node; the stage boundary "
        "moves max_num_seqs=128 × hidden_size=16384 × 2 B = 4.0 MiB of hidden states per decode step, "
        "0.5 ms each: 0.5 ms per decode step in all; and the last stage returns max_num_seqs=128 × "
        "vocab_size=128256 × 4 B = 62.6 MiB of FP32 logits to the leader per decode step"
    )
    assert result.reasons["kv_cache_memory_bytes"] == (
        "min(room left on a card: 35.43 GiB, KV of max_num_seqs=128 sequences of max_model_len=8192: "
        "31.50 GiB); holds 1048576 tokens (128.0 full-length sequences) at 32256 B/token per card (the "
        "stage with the most layers, 63 of 126; every stage holds as many blocks)"
    )


def test_too_big_for_the_nodes_allowed_raises_with_the_numbers() -> None:
    with pytest.raises(TuningError) as info:  # stages of [31, 32, 32, 31] layers: a middle one is fullest
        recommend(make_measurements(LLAMA_405B), Targets(cards_per_node=1, max_nodes=4))
    assert str(info.value) == (
        "the model does not fit: at TP 1 (the largest of [1], 1 card(s) per node) over 4 nodes (at most "
        "--max-nodes 4 and one per layer) the fullest card needs weights 190.00 GiB + activations 300.0 MiB "
        "+ one 8192-token sequence of KV (1.00 GiB) = 191.29 GiB, over 90% of 96.00 GiB (86.40 GiB); weights "
        "755.96 GiB in all; lower max_model_len, use cards with more memory or allow more nodes"
    )


def test_no_tp_size_dividing_the_model_raises() -> None:
    odd = ModelFacts("odd", "bfloat16", 2, 6, 2, 64, GIB, 4096)
    with pytest.raises(TuningError) as info:
        recommend(
            make_measurements((odd, ModelParts(384, 1000, 32000, GIB // 2, 0, 0))), Targets(tp_sizes=(4, 8))
        )
    assert str(info.value) == (
        "no TP size of [4, 8] within 8 card(s) here divides the model's 6 heads, 2 KV heads and intermediate "
        "size 1000"
    )


def test_intermediate_size_limits_the_tp_size() -> None:
    # 8 divides the heads but not the intermediate size (sharding refuses it): TP 4 over 2 nodes
    model = make_model("narrow-mlp", 80, 8192, 28668, 64, 8, 128256, 131072)
    result = recommend(make_measurements(model), Targets(tp_sizes=(8, 4)))
    assert result.options["tensor_parallel_size"] == 4
    assert result.reasons["tensor_parallel_size"].startswith("smallest TP size (of [4]) ")


def test_part_bytes_counts_a_tied_lm_head_in_full() -> None:
    model = torch.nn.Module()
    model.embed_tokens = torch.nn.Embedding(10, 4)  # 40 floats
    model.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4, bias=False) for _ in range(3))  # 16 each
    model.norm = torch.nn.LayerNorm(4, bias=False)  # 4
    model.lm_head = torch.nn.Linear(4, 10, bias=False)
    model.lm_head.weight = model.embed_tokens.weight  # tied
    assert part_bytes(model) == (16 * 4, 40 * 4, (4 + 40) * 4)
    assert part_bytes(torch.nn.Linear(2, 2)) is None


def test_tune_writes_pipeline_parallel_size_and_serve_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class FakeProfiler:  # the real one needs the model; this one hands over 405B-class facts
        def __init__(self, options: profiler.ProfileOptions) -> None:
            pass

        def run(self) -> Measurements:
            return make_measurements(LLAMA_405B)

    monkeypatch.setattr(profiler, "Profiler", FakeProfiler)
    out = tmp_path / "tune.yaml"
    args = Namespace(
        model=None, device="auto", dtype="auto", max_model_len=None, budget_s=60.0, out=out,
        memory_fraction=0.9, decode_step_target_ms=100.0, max_prefill_step_ms=500.0, seed=0,
        cards_per_node=8, max_nodes=16, stage_boundary_ms=0.5,
    )  # fmt: skip
    assert tune_cli.run_tune(args) == 0
    document = yaml.safe_load(out.read_text())
    assert (document["engine"]["tensor_parallel_size"], document["engine"]["pipeline_parallel_size"]) == (
        8,
        2,
    )
    assert (
        "4.0 MiB of hidden states per decode step, 0.5 ms each" in document["why"]["pipeline_parallel_size"]
    )
    assert document["measurements"]["parts"]["layer_bytes"] == 6_375_407_616
    assert load_engine_options(out)["pipeline_parallel_size"] == 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"cards_per_node": 0}, "cards_per_node: must be >= 1, got 0"),
        ({"max_nodes": 0}, "max_nodes: must be >= 1, got 0"),
        ({"stage_boundary_ms": -1.0}, "stage_boundary_ms: must be a time in ms >= 0, got -1"),
    ],
)
def test_tune_rejects_bad_node_options(change: dict[str, object], message: str) -> None:
    args = Namespace(
        model=None, device="auto", dtype="auto", max_model_len=None, budget_s=60.0, out=None,
        memory_fraction=0.9, decode_step_target_ms=100.0, max_prefill_step_ms=500.0, seed=0,
        cards_per_node=None, max_nodes=16, stage_boundary_ms=None,
    )  # fmt: skip
    for key, value in change.items():
        setattr(args, key, value)
    with pytest.raises(ConfigError, match=message):
        tune_cli.run_tune(args)


def test_tune_files_from_before_the_parts_still_load() -> None:
    data = make_measurements(LLAMA_405B).to_dict()
    assert Measurements.from_dict(data) == make_measurements(LLAMA_405B)
    del data["parts"]
    assert Measurements.from_dict(data).parts is None

"""The recommender (a pure function) on synthetic measurements, the budget on a fake clock, and the
config-file loader that reads the tune YAML back."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml

from kunlun_device.xpu import XpuSource
from kunlun_runtime.errors import ConfigError
from kunlun_runtime.options.config_file import load_engine_options
from kunlun_runtime.platforms import CpuPlatform
from kunlun_runtime.platforms.kunlun import KunlunPlatform
from kunlun_runtime.tuning import Measurements, Targets, TuningError, recommend
from kunlun_runtime.tuning.budget import Budget
from kunlun_runtime.tuning.cli import build_document
from kunlun_runtime.tuning.facts import count_cards, model_bytes
from kunlun_runtime.tuning.measurements import (
    BlockSizePoint,
    DecodePoint,
    ModelFacts,
    PlatformFacts,
    PrefillPoint,
)
from kunlun_runtime.tuning.profiler import predict_cost

GIB, MIB = 1 << 30, 1 << 20
P800 = PlatformFacts("kunlun", 8, 96 * GIB, "device memory per card")
CPU = PlatformFacts("cpu", 1, 16 * GIB, "host memory available before loading")
QWEN7B = ModelFacts("Qwen2-7B", "bfloat16", 28, 28, 4, 128, 15_231_233_024, 32768)
LLAMA70B = ModelFacts("Llama-70B", "bfloat16", 80, 64, 8, 128, 141_107_691_520, 8192)
TINY = ModelFacts("tiny", "float32", 2, 4, 2, 16, 200_000, 512)
PREFILL = [(256, 0.020), (512, 0.032), (1024, 0.060), (2048, 0.118), (4096, 0.240)]
DECODE = [(1, 0.020), (8, 0.022), (32, 0.030), (64, 0.045), (128, 0.080), (256, 0.150)]
BLOCKS = [(8, 0.033, 57792), (16, 0.031, 57568), (32, 0.030, 57456), (64, 0.0305, 57400), (128, 0.036, 57372)]


def make_measurements(
    platform: PlatformFacts = P800,
    model: ModelFacts = QWEN7B,
    prefill: list[tuple[int, float]] = PREFILL,
    decode: list[tuple[int, float]] = DECODE,
    blocks: list[tuple[int, float, int]] = BLOCKS,
) -> Measurements:
    return Measurements(
        platform=platform,
        model=model,
        prefill=tuple(PrefillPoint(n, t, 3, 300 * MIB) for n, t in prefill),
        decode=tuple(DecodePoint(s, 64, t, 3) for s, t in decode),
        block_sizes=tuple(BlockSizePoint(b, 8, 256, t, kv, 3) for b, t, kv in blocks),
        kv_block_bytes={b: kv * b for b, _, kv in blocks},
        budget_seconds=60.0,
        elapsed_seconds=42.0,
    )


PREFILL_WHY = (
    "smallest measured prefill reaching 90% of the best throughput (17356 tokens/s at 2048 tokens): "
    "512 tokens in 32.0 ms (16000 tokens/s)"
)
SEQS_WHY = (
    "largest measured decode batch whose step stays within the 100.0 ms target: 128 sequences in 80.0 ms "
    "(1600 tokens/s); 256 took 150.0 ms"
)


def test_seven_b_on_an_eight_card_p800_node() -> None:
    result = recommend(make_measurements())
    assert result.options == {
        "dtype": "bfloat16",
        "max_model_len": 32768,
        "block_size": 64,
        "max_num_seqs": 128,
        "max_num_batched_tokens": 512,
        "kv_cache_memory_bytes": 77_224_476_672,  # (0.9 × 96 GiB − weights − 300 MiB) rounded down to MiB
        "tensor_parallel_size": 1,
    }
    assert result.reasons == {
        "dtype": "the dtype the measurements were taken in (kunlun's default unless --dtype)",
        "max_model_len": "the context length the KV memory is planned for",
        "block_size": "decode of 8 sequences × 256 tokens by block size: 8: 33.0 ms, 16: 31.0 ms, "
        "32: 30.0 ms, 64: 30.5 ms, 128: 36.0 ms; within 10% of the fastest (32), 64 needs the least KV "
        "memory per token (57400 B, padding included)",
        "max_num_seqs": SEQS_WHY,
        "max_num_batched_tokens": PREFILL_WHY,
        "kv_cache_memory_bytes": "min(room left on a card: 71.92 GiB, KV of max_num_seqs=128 sequences "
        "of max_model_len=32768: 224.22 GiB); holds 1345344 tokens (41.1 full-length sequences) at "
        "57400 B/token per card",
        "tensor_parallel_size": "smallest TP size (of [1, 2, 4]) at which a card holds its weights "
        "(14.19 GiB), activations (300.0 MiB) and one 32768-token sequence of KV (1.75 GiB) within 90% of "
        "96.00 GiB (device memory per card); 8 card(s) here",
    }


def test_seventy_b_needs_two_cards_and_kv_per_card_halves() -> None:
    result = recommend(make_measurements(model=LLAMA70B, blocks=[]))
    assert result.options == {
        "dtype": "bfloat16",
        "max_model_len": 8192,
        "block_size": 16,
        "max_num_seqs": 128,
        "max_num_batched_tokens": 512,
        "kv_cache_memory_bytes": 21_902_655_488,
        "tensor_parallel_size": 2,
    }
    assert result.reasons["tensor_parallel_size"] == (
        "smallest TP size (of [1, 2, 4, 8]) at which a card holds its weights (65.71 GiB), activations "
        "(300.0 MiB) and one 8192-token sequence of KV (1.25 GiB) within 90% of 96.00 GiB (device memory per "
        "card); 8 card(s) here"
    )
    # unpadded 2 × 80 layers × 8 KV heads × 128 × 2 B = 327680 B/token, half of the heads per card
    assert result.reasons["kv_cache_memory_bytes"] == (
        "min(room left on a card: 20.40 GiB, KV of max_num_seqs=128 sequences of max_model_len=8192: "
        "160.00 GiB); holds 133680 tokens (16.3 full-length sequences) at 163840 B/token per card"
    )
    assert result.reasons["block_size"] == "block sizes not measured (budget); the engine's default"


def test_slow_hardware_bounds_by_slowdown_and_smallest_prefill() -> None:
    measurements = make_measurements(
        CPU, TINY, prefill=[(16, 0.8), (32, 1.2)], decode=[(1, 0.3), (2, 0.5), (4, 0.9)], blocks=[]
    )
    result = recommend(measurements)
    assert result.options == {
        "dtype": "float32",
        "max_model_len": 512,
        "block_size": 16,
        "max_num_seqs": 2,
        "max_num_batched_tokens": 16,
        # two full sequences of 2 × 2 layers × 2 KV heads × 16 × 4 B per token; below a MiB: not rounded
        "kv_cache_memory_bytes": 2 * 512 * 512,
        "tensor_parallel_size": 1,
    }
    # block sizes untimed, but their padded layout known: the KV plan uses it (as the engine will)
    padded = recommend(replace(measurements, kv_block_bytes={8: 2304, 16: 4352}))
    assert padded.options["kv_cache_memory_bytes"] == 2 * 32 * 4352
    assert result.reasons["max_num_seqs"] == (
        "largest measured decode batch whose step stays within 2× the 1-sequence step (600.0 ms): "
        "2 sequences in 500.0 ms (4 tokens/s); 4 took 900.0 ms"
    )
    assert result.reasons["max_num_batched_tokens"] == (
        "smallest measured prefill reaching 90% of the best throughput (27 tokens/s at 32 tokens): 32 tokens "
        "in 1200.0 ms (27 tokens/s); no measured prefill step is within 500.0 ms: the smallest, 16 tokens "
        "(800.0 ms)"
    )


def test_prefill_knee_is_capped_and_raised_to_max_num_seqs() -> None:
    prefill = [(64, 0.2), (128, 0.4), (256, 0.6), (512, 1.2)]  # knee at 256 (600 ms) is over the cap
    result = recommend(make_measurements(prefill=prefill, decode=[(1, 0.01), (256, 0.09)]))
    assert (result.options["max_num_seqs"], result.options["max_num_batched_tokens"]) == (256, 256)
    assert result.reasons["max_num_batched_tokens"] == (
        "smallest measured prefill reaching 90% of the best throughput (427 tokens/s at 256 tokens): "
        "256 tokens in 600.0 ms (427 tokens/s); capped to 128 tokens (400.0 ms) to keep a prefill step "
        "within 500.0 ms; "
        "raised to max_num_seqs=256 so that one step can decode every running sequence"
    )
    assert result.reasons["max_num_seqs"].endswith("(the largest batch measured)")


def test_block_size_ties_go_to_the_smaller_block() -> None:
    blocks = [(32, 0.050, 1000), (16, 0.052, 1000), (8, 0.040, 1100)]
    assert recommend(make_measurements(blocks=blocks)).options["block_size"] == 8
    blocks = [(32, 0.050, 1000), (16, 0.052, 1000), (8, 0.060, 1100)]
    assert recommend(make_measurements(blocks=blocks)).options["block_size"] == 16


def test_tp_sizes_respect_head_counts_and_card_count() -> None:
    heads_6 = ModelFacts("m", "bfloat16", 2, 6, 2, 64, 150 * GIB, 4096)  # needs TP 2; 4 and 8 do not divide 6
    assert recommend(make_measurements(model=heads_6, blocks=[])).options["tensor_parallel_size"] == 2
    one_card = make_measurements(platform=PlatformFacts("kunlun", 1, 96 * GIB, "x"), model=heads_6)
    with pytest.raises(TuningError) as info:  # one node only: pipeline parallelism cannot help
        recommend(one_card, Targets(max_nodes=1))
    assert str(info.value) == (
        "the model does not fit: weights 150.00 GiB + activations 300.0 MiB + one 4096-token sequence of KV "
        "exceed 90% of 96.00 GiB per card at every TP size in [1] (1 card(s)); lower max_model_len or use "
        "more cards"
    )
    # allowed more nodes, two one-card nodes hold 75 GiB each (tests/unit/runtime/test_tuning_parallel.py)
    assert recommend(one_card).options["pipeline_parallel_size"] == 2


def test_nothing_measured_is_an_error_and_targets_are_honoured() -> None:
    with pytest.raises(TuningError, match="no prefill or decode step was measured; raise --budget-s"):
        recommend(make_measurements(decode=[]))
    relaxed = recommend(make_measurements(), Targets(decode_step_target_seconds=0.2, memory_fraction=0.5))
    assert relaxed.options["max_num_seqs"] == 256
    room = int(0.5 * 96 * GIB) - 15_231_233_024 - 300 * MIB
    assert relaxed.options["kv_cache_memory_bytes"] == room // MIB * MIB


def test_measurements_round_trip_through_their_dict() -> None:
    measurements = make_measurements()
    assert Measurements.from_dict(yaml.safe_load(yaml.safe_dump(measurements.to_dict()))) == measurements


def test_budget_phases_on_a_fake_clock() -> None:
    now = [100.0]
    budget = Budget(60.0, clock=lambda: now[0])
    budget.phase(0.5)  # 30 s of the 60 left
    assert (budget.allows(30.0), budget.allows(30.5)) == (True, False)
    now[0] += 40.0
    assert (budget.elapsed(), budget.remaining()) == (40.0, 20.0)
    budget.phase(1.0)
    assert (budget.allows(20.0), budget.allows(20.5)) == (True, False)
    now[0] += 25.0
    assert budget.remaining() == 0.0
    with pytest.raises(ValueError, match="budget must be positive, got 0"):
        Budget(0)


def write(tmp_path: Path, data: object, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def test_tune_document_loads_as_engine_options(tmp_path: Path) -> None:
    measurements = make_measurements()
    recommendation = recommend(measurements)
    path = write(tmp_path, build_document(measurements, recommendation))
    assert load_engine_options(path) == recommendation.options


def test_flat_files_take_flag_spellings_and_sizes(tmp_path: Path) -> None:
    path = write(tmp_path, {"max-num-seqs": 8, "kv-cache-memory": "64MiB", "enable_prefix_caching": False})
    assert load_engine_options(path) == {
        "max_num_seqs": 8,
        "kv_cache_memory_bytes": 64 * MIB,
        "enable_prefix_caching": False,
    }


@pytest.mark.parametrize(
    ("data", "field", "message"),
    [
        ({"max_num_seq": 8}, "max_num_seq", "max_num_seq: unknown engine option (known: block_size, "),
        ({"block_size": "16"}, "block_size", "block_size: must be int, got str '16'"),
        ({"max_num_seqs": True}, "max_num_seqs", "max_num_seqs: must be int, got bool True"),
        ({"max_model_len": 1.5}, "max_model_len", "max_model_len: must be int or null, got float 1.5"),
        ({"block-size": 24}, "block-size", "block_size: must be 8, 16, 32, 64 or 128, got 24"),
        ({"kv_cache_memory": "lots"}, "kv_cache_memory", "kv_cache_memory: cannot parse memory size 'lots'"),
        ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes", "kv_cache_memory: must be positive"),
        ({"max_num_seqs": 8, "max-num-seqs": 9}, "max_num_seqs", "given twice (also as 'max-num-seqs')"),
        ({"engine": {}, "notes": "x"}, "notes", "notes: unknown section (a tune file has engine, why, "),
        ({"engine": [1]}, "engine", "engine: must be a mapping of engine options"),
        ("- 1\n", "config", "expected a mapping of engine options"),
        ("a: [\n", "config", "not valid YAML"),
    ],
)
def test_bad_files_name_the_key(tmp_path: Path, data: object, field: str, message: str) -> None:
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        load_engine_options(path)
    assert info.value.field == field
    assert str(info.value).startswith(f"{path}: ")
    assert message in str(info.value)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.yaml: cannot read"):
        load_engine_options(tmp_path / "nope.yaml")


def test_model_bytes_counts_every_held_tensor_once() -> None:
    layer = torch.nn.Linear(8, 4, bias=False)  # 32 floats
    layer.register_buffer("scale", torch.ones(4))  # 4 floats
    layer.shared = layer.weight.detach()  # same storage as the weight: not counted again
    layer.packed = torch.zeros(10, dtype=torch.bfloat16)  # a plain tensor attribute: counted
    model = torch.nn.Sequential(layer, torch.nn.Sequential(layer))  # the same module twice: once
    assert model_bytes(model) == 32 * 4 + 4 * 4 + 10 * 2


def test_card_count_of_cpu_and_kunlun_fixture_host() -> None:
    fixture = Path(__file__).resolve().parents[2] / "fixtures" / "xpu" / "p800-8"
    kunlun = KunlunPlatform(XpuSource(str(fixture / "xpu-smi"), fixture / "root"), env={})
    assert (count_cards(CpuPlatform()), count_cards(kunlun)) == (1, 8)


def test_point_costs_are_extrapolated_from_the_last_two() -> None:
    assert predict_cost([(16, 1.0)], 32) == 2.5  # proportional to size, × 1.25
    assert predict_cost([(16, 1.0), (32, 1.2)], 64) == pytest.approx((1.2 + 32 * 0.2 / 16) * 1.25)
    assert predict_cost([(16, 2.0), (32, 1.0)], 64) == 1.25  # never below the last cost

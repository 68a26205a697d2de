"""The one door from the server into the engine: what ``AsyncEngine`` reads of the ``LLMEngine``
(its facts once, its counters and waiting queue after each step) is what the engine holds, and
constraints compile through it with the field named when they are refused."""

from __future__ import annotations

import pytest

from kunlun_runtime.config import EngineConfig, parse_memory
from kunlun_runtime.engine.llm_engine import LLMEngine
from kunlun_runtime.engine.sampling_params import SamplingParams
from kunlun_runtime.errors import InvalidRequestError
from kunlun_runtime.server.async_engine import AsyncEngine
from kunlun_runtime.server.engine_facts import EngineFacts
from kunlun_runtime.server.metrics import CacheConfigInfo
from kunlun_runtime.structured.grammar import CONSTRAINT_KINDS
from kunlun_runtime.structured.params import StructuredOutputsParams
from tests.support.tiny_models import make_tiny_model

PROMPT = [5, 17, 99]


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LLMEngine:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("door") / "tiny")
    config = EngineConfig(
        model=str(model_dir),
        dtype="float32",
        max_model_len=32,
        max_num_seqs=1,  # one request runs, the others wait: the waiting queue is visible
        kv_cache_memory_bytes=parse_memory("4MiB"),
        served_model_name="door-test",
    )
    return LLMEngine(config)


def drain(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def test_the_facts_are_the_engines_own(engine) -> None:
    facts = AsyncEngine(engine).facts
    assert facts == EngineFacts(
        served_model_name="door-test",
        max_model_len=32,
        vocab_size=engine.model_config.vocab_size,
        model_dir=engine.model_dir,
        runtime_info=engine.runtime_info,
        cache_config=CacheConfigInfo(
            block_size=16,
            num_gpu_blocks=engine.block_pool.num_blocks,
            enable_prefix_caching=True,
            cache_dtype="float32",
            kv_cache_memory_bytes=4 << 20,
        ),
    )


def test_counters_and_waiting_ids_follow_the_scheduler(engine) -> None:
    drain(engine)
    before = AsyncEngine(engine).counters()
    for request_id in ("a", "b", "c"):
        engine.add_request(request_id, PROMPT, SamplingParams(max_tokens=2, ignore_eos=True))
    assert engine.waiting_request_ids() == ["a", "b", "c"]
    engine.step()  # "a" is admitted (max_num_seqs=1), prefilled and samples its first token
    assert engine.waiting_request_ids() == ["b", "c"]
    after = engine.counters()
    assert (after.num_running, after.num_waiting) == (1, 2)
    assert after.kv_cache_usage_ratio == pytest.approx(1 / engine.block_pool.num_blocks)  # 3 tokens: 1 block
    assert after.num_generation_tokens_total - before.num_generation_tokens_total == 1
    assert after.num_prompt_tokens_total - before.num_prompt_tokens_total == len(PROMPT)
    drain(engine)
    done = engine.counters()
    assert (done.num_running, done.num_waiting, done.kv_cache_usage_ratio) == (0, 0, 0.0)
    assert done.num_generation_tokens_total - before.num_generation_tokens_total == 3 * 2


def test_structured_requests_are_counted_per_kind(engine) -> None:
    before = engine.counters()
    choice = StructuredOutputsParams(choice=("yes", "no"))
    engine.add_request("s", PROMPT, SamplingParams(max_tokens=4, structured_outputs=choice))
    drain(engine)
    after = engine.counters()
    asked = dict(before.structured_requests_total)
    gained = {kind: count - asked[kind] for kind, count in after.structured_requests_total}
    assert gained == {kind: int(kind == "choice") for kind in CONSTRAINT_KINDS}
    assert after.structured_mask_seconds_total > before.structured_mask_seconds_total


def test_a_refused_constraint_names_its_field(engine) -> None:
    door = AsyncEngine(engine)
    door.compile_structured(StructuredOutputsParams(regex="a+", source="guided_regex"))
    with pytest.raises(InvalidRequestError) as caught:
        door.compile_structured(StructuredOutputsParams(regex="(", source="guided_regex"))
    assert caught.value.field == "guided_regex"

"""benchmarks/replay_drafting.py: greedy outputs replayed through the engine's proposer count the
steps speculation would take (the tokens are the output's whatever the drafts)."""

import subprocess
import sys

import pytest

from kunlun_runtime import LLM
from kunlun_runtime.config import SpeculativeConfig
from tests.support.benchmark_scripts import BENCHMARKS, load_benchmark
from tests.support.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def replay_module():
    sys.path.insert(0, str(BENCHMARKS))  # it imports bench_speculative beside it
    try:
        yield load_benchmark("replay_drafting")
    finally:
        sys.path.remove(str(BENCHMARKS))


NGRAM = SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_min=1, prompt_lookup_max=8)


@pytest.fixture
def prices(replay_module):
    return replay_module.StepPrices(step_ms=10.0, request_ms=5.0, row_ms=1.0)


def test_an_output_that_copies_its_prompt_takes_a_step_per_six_tokens(replay_module, prices):
    prompt = list(range(100, 140))
    output = prompt[10:30]  # its first token came with the prefill; 19 to go
    result = replay_module.replay(NGRAM, [(prompt, output)], prices)
    # 5 drafts and the token after them a step (6, 6, 6), then the last token alone (no room)
    assert (result.steps, result.draft_rows, result.accepted, result.steps_without_drafts) == (4, 15, 15, 1)
    assert result.speedup == pytest.approx(19 * 10.0 / (4 * 10.0 + 15 * 1.0))


def test_an_output_with_nothing_to_copy_takes_a_step_per_token(replay_module, prices):
    prompt = list(range(100, 140))
    output = list(range(500, 520))
    result = replay_module.replay(NGRAM, [(prompt, output)], prices)
    assert (result.steps, result.draft_rows, result.speedup) == (19, 0, 1.0)


def test_a_failed_draft_costs_its_row_and_the_step_still_emits_the_models_token(replay_module, prices):
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    output = [1, 2, 9, 9, 9]  # copies [1, 2], then leaves the prompt
    result = replay_module.replay(NGRAM, [(prompt, output)], prices)
    assert result.accepted == 1  # after [1], the draft [2, 3, ...] holds for one token
    assert result.steps + result.accepted == len(output) - 1
    assert result.speedup < 4 / 3
    # The oracle runs the one draft that holds and none of those after it: every row accepted.
    oracle = replay_module.replay(NGRAM, [(prompt, output)], prices, oracle=True)
    assert (oracle.draft_rows, oracle.accepted, oracle.steps) == (1, 1, 3)
    assert oracle.speedup == pytest.approx(4 * 10.0 / (3 * 10.0 + 1 * 1.0))
    assert oracle.speedup > result.speedup


def test_the_oracle_shares_the_steps_rows_as_the_engine_does(replay_module, prices, monkeypatch):
    prompt = list(range(100, 140))
    copying = [(prompt, prompt[10:30]), (prompt, prompt[12:32])]
    free = replay_module.replay(NGRAM, copying, prices, batch=2, oracle=True)
    assert (free.steps, free.draft_rows, free.accepted) == (4, 30, 30)  # 5 drafts each a step
    monkeypatch.setattr(replay_module, "MAX_ROWS", 3)  # one draft row beside two decode rows
    capped = replay_module.replay(NGRAM, copying, prices, batch=2, oracle=True)
    # The first request takes the one row while both decode (2 tokens a step; its last step has
    # no room for a draft, and the second takes the row); then the second has two rows alone.
    assert (capped.steps, capped.draft_rows, capped.accepted) == (13, 9 + 6, 9 + 6)


def test_a_batch_decodes_in_lockstep_and_a_finished_request_leaves_it(replay_module, prices):
    prompt = list(range(100, 140))
    copying, fresh = prompt[10:30], list(range(500, 520))  # 19 tokens to go each
    result = replay_module.replay(NGRAM, [(prompt, copying), (prompt, fresh)], prices, batch=2)
    # The copying request finishes in 4 steps (as alone); the other drafts nothing and takes 19,
    # alone once the first has left.
    assert (result.steps, result.accepted) == (19, 15)
    plain_ms = 19 * (10.0 + 5.0)
    spec_ms = 4 * (10.0 + 5.0) + 15 * 10.0 + result.draft_rows * 1.0
    assert result.speedup == pytest.approx(plain_ms / spec_ms)
    # Two batches of one are each priced alone: the same steps, no second request's share.
    apart = replay_module.replay(NGRAM, [(prompt, copying), (prompt, fresh)], prices, batch=1)
    assert (apart.steps, apart.accepted) == (4 + 19, 15)


def test_the_command_replays_every_config_on_both_workloads_in_flight_at_each_row_price(tmp_path):
    model_dir = make_tiny_model(tmp_path / "tiny")
    command = [
        sys.executable, str(BENCHMARKS / "replay_drafting.py"), "--quick", "--model", str(model_dir),
        "--dtype", "float32", "--configs", '[{"method": "ngram"}, {"method": "suffix"}]', "--batch", "8",
        "--in-flight", "--prompts", "10", "--row-ms", "1.0", "0.25",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    blocks = done.stdout.split("batch 8 in flight, 10 prompts;")
    assert blocks[0] == "" and len(blocks) == 3
    assert "a draft row 1.0 ms" in blocks[1] and "a draft row 0.25 ms" in blocks[2]
    oracles = []
    for block in blocks[1:]:
        lines = [line for line in block.splitlines() if " steps, " in line]
        assert [line.split(" {")[0] for line in lines] == ["copy", "copy", "free", "free"]
        assert all('"method": "ngram"' in line for line in lines[::2])
        assert all("; oracle " in line for line in lines)
        oracles.append([line.split("; oracle ")[1] for line in lines])
    # The same outputs at both prices: the oracle runs the same steps and rows (exactly the drafts
    # that hold, whatever they cost), each row cheaper at the second price.
    for dear, cheap in zip(*oracles, strict=True):
        assert dear.split("x, ")[1] == cheap.split("x, ")[1]
        assert float(cheap.split("x")[0]) >= float(dear.split("x")[0])


def test_in_flight_a_leaving_request_is_replaced_and_only_full_steps_count(replay_module, prices):
    prompt = list(range(100, 140))
    copying, fresh = (prompt, prompt[10:30]), (prompt, list(range(500, 520)))
    result = replay_module.replay(
        NGRAM, [copying, fresh, (prompt, prompt[12:32])], prices, batch=2, in_flight=True
    )
    # Each copying request takes 4 steps (as alone) and the third enters as the first leaves:
    # 8 steps with both in flight (38 copied tokens and 8 of the fresh one's), then the fresh one
    # alone for its last 11 tokens, which do not count.
    assert (result.steps, result.accepted) == (8 + 11, 30)
    full_ms = 8 * (10.0 + 5.0) + result.draft_rows * 1.0  # the fresh request drafted nothing
    assert result.speedup == pytest.approx((38 + 8) / full_ms / (2 / (10.0 + 5.0)))
    closed = replay_module.replay(NGRAM, [copying, fresh, (prompt, prompt[12:32])], prices, batch=2)
    assert closed.steps == 19 + 4 and closed.speedup < result.speedup
    with pytest.raises(ValueError, match="at least 4 prompts"):
        replay_module.replay(NGRAM, [copying, fresh], prices, batch=4, in_flight=True)


def test_outputs_are_generated_as_the_replayed_batch_runs_them(replay_module, tmp_path):
    # Prompts prefilled together share matrix multiplies whose rows' bits follow the step's other
    # rows: a batch-1 replay must draft over the outputs each prompt has alone.
    llm = LLM(str(make_tiny_model(tmp_path / "tiny")), dtype="float32")
    calls = []
    generate = llm.generate

    def recording(prompts, params):
        calls.append(len(prompts))
        return generate(prompts, params)

    llm.generate = recording
    try:
        conversations = sys.modules["bench_speculative"].free_tasks(3)
        alone = replay_module.greedy_outputs(llm, conversations, 4)
        assert calls == [1, 1, 1]
        calls.clear()
        paired = replay_module.greedy_outputs(llm, conversations, 4, batch=2)
        assert calls == [2, 1]
    finally:
        llm.close()
    assert [prompt for prompt, _ in paired] == [prompt for prompt, _ in alone]
    assert all(len(output) == 4 for _, output in alone + paired)


def test_free_generation_prompts_never_repeat(replay_module):
    bench = sys.modules["bench_speculative"]  # imported by the replay beside it
    prompts = bench.free_tasks(24)
    assert len({prompt[0]["content"] for prompt in prompts}) == 24
    with pytest.raises(ValueError, match="at most 24 distinct"):
        bench.free_tasks(25)

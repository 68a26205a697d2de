"""benchmarks/bench_speculative.py: the engines take turns batch by batch (in flight, run by run),
the order reversed from one turn to the next, and each side's rates come from its own batches."""

import json

import pytest

from kunlun_runtime import LLM
from tests.support.benchmark_scripts import BENCHMARKS, load_benchmark
from tests.support.tiny_models import make_tiny_model


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # it imports engine_batches and llama_lookup
    return load_benchmark("bench_speculative")


@pytest.fixture
def engines(bench, tmp_path):
    """A plain and an ngram engine on a tiny model, and the list to which each adds (side, prompt
    length) as a request is added."""
    model = make_tiny_model(tmp_path / "tiny")
    llms = {
        "plain": LLM(str(model), dtype="float32", max_num_seqs=16),
        "ngram": LLM(str(model), dtype="float32", max_num_seqs=16, speculative_config=bench.SPEC),
    }
    added: list[tuple[str, int]] = []
    for side, llm in llms.items():
        add = llm.engine.add_request

        def recording_add(request_id, prompt, params, side=side, add=add, **kwargs):
            added.append((side, len(prompt["prompt_token_ids"])))
            return add(request_id, prompt, params, **kwargs)

        llm.engine.add_request = recording_add
    yield llms, added
    for llm in llms.values():
        llm.close()


def test_closed_batches_alternate_between_the_sides_in_reversed_order(bench, engines):
    llms, added = engines
    tasks = bench.free_tasks(bench.CLOSED_TASKS)
    lengths = [len(ids) for ids in bench.prompt_ids(llms["plain"], tasks)]
    rates = bench.measure(llms, ["plain", "ngram"], tasks, 2, 4)
    # Four batches of two prompts: plain then ngram, ngram then plain, and so on, each side
    # adding the batch's own prompts.
    order = ["plain", "ngram", "ngram", "plain"] * 2
    expected = [
        (side, lengths[2 * batch + index])
        for batch, pair in enumerate(zip(order[::2], order[1::2], strict=True))
        for side in pair
        for index in range(2)
    ]
    assert added == expected
    for measured in rates.values():
        assert measured.rate > 0 and measured.requests_rate is not None and measured.requests_rate > 0
    # Eight prompts, 3 tokens after each first: without drafts a token a step, with them at least.
    assert rates["plain"].tokens == rates["plain"].request_steps == 8 * 3
    assert rates["ngram"].tokens == 8 * 3 and 0 < rates["ngram"].request_steps <= 8 * 3
    assert bench.yield_per_step([rates["plain"]]) == 1.0


def test_a_closed_batch_of_eight_runs_in_turns(bench, engines):
    # The 8 prompts make one batch of 8: each side runs it CLOSED_TURNS times, taking turns in
    # reversed order (one batch a side left the ratio to a moment of the machine's speed).
    llms, added = engines
    tasks = bench.free_tasks(bench.CLOSED_TASKS)
    lengths = [len(ids) for ids in bench.prompt_ids(llms["plain"], tasks)]
    rates = bench.measure(llms, ["plain", "ngram"], tasks, 8, 4)
    assert bench.CLOSED_TURNS % 2 == 0
    order = ["plain", "ngram", "ngram", "plain"] * (bench.CLOSED_TURNS // 2)
    assert added == [(side, length) for side in order for length in lengths]
    assert rates["plain"].tokens == rates["plain"].request_steps == bench.CLOSED_TURNS * 8 * 3


def test_in_flight_runs_alternate_between_the_sides(bench, engines):
    llms, added = engines
    tasks = bench.free_tasks(10)
    lengths = [len(ids) for ids in bench.prompt_ids(llms["plain"], tasks)]
    rates = bench.measure(llms, ["plain", "ngram"], tasks, bench.IN_FLIGHT, 4)
    # Each run adds all the prompts in order; the runs go plain, ngram, then ngram, plain, and so on.
    assert bench.IN_FLIGHT_TURNS % 2 == 0
    runs = ["plain", "ngram", "ngram", "plain"] * (bench.IN_FLIGHT_TURNS // 2)
    assert added == [(side, length) for side in runs for length in lengths]
    for measured in rates.values():
        assert measured.rate > 0 and measured.requests_rate is None
        # Timed steps have all requests in flight decoding: a token each without drafts.
        assert measured.tokens >= measured.request_steps > 0
        assert measured.request_steps % bench.IN_FLIGHT_REQUESTS == 0
    assert rates["plain"].tokens == rates["plain"].request_steps


def test_chosen_cells_alone_are_measured_and_reported(bench, tmp_path, capsys):
    # One noisy cell can be measured again without the whole 35-minute run: only the chosen
    # workloads and batches run, and only they are reported and judged.
    model = make_tiny_model(tmp_path / "tiny")
    results = tmp_path / "results.json"
    argv = ["--quick", "--model", str(model), "--dtype", "float32", "--methods", "ngram"]
    argv += ["--workloads", "copy", "--batches", "1", "in-flight", "--json", str(results)]
    assert bench.main(argv) == 0
    report = json.loads(results.read_text())
    cells = {key for key in report["ngram"] if key.startswith(("copy_", "free_"))}
    assert cells == {"copy_batch1", "copy_batch8_in_flight"}
    printed = capsys.readouterr().out
    assert "ngram copy batch 1:" in printed and "ngram copy batch 8 in flight:" in printed
    assert "free" not in printed and "batch 8:" not in printed


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--workloads", "copy,chat"], "--workloads: copy and free only, not chat"),
        (["--batches", "4"], "argument --batches: invalid choice: '4'"),
    ],
)
def test_an_unknown_cell_is_rejected_before_anything_runs(bench, capsys, argv, message):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err

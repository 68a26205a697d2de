"""benchmarks/llama_lookup.py: the command lines of llama.cpp's three sides and the parsing of its
programs' reports (their format as llama-lookup and llama-speculative-simple print it)."""

import pytest

from tests.support.benchmark_scripts import load_benchmark

llama_lookup = load_benchmark("llama_lookup")

# The tail of a llama-lookup report (examples/lookup/lookup.cpp), stdout and stderr together.
LOOKUP_REPORT = """<|im_start|>assistant
Section 3. On 12 May ...

encoded 1531 tokens in    1.204 seconds, speed: 1271.595 t/s
decoded  129 tokens in    0.911 seconds, speed:  141.602 t/s

n_draft      = 5
n_predict    = 129
n_drafted    = 215
t_draft_flat = 0.41 ms
t_draft      = 1.02 ms, 4.74 us per token, 210784.31 tokens per second
n_accept     = 97
accept       = 45.116%

target:
"""

# The tail of a llama-speculative-simple report (examples/speculative-simple).
SPECULATIVE_REPORT = """encoded  212 tokens in    0.150 seconds, speed: 1413.333 t/s
decoded  130 tokens in    1.480 seconds, speed:   87.838 t/s

n_draft   = 3
n_predict = 130
n_drafted = 40
n_accept  = 12
accept    = 30.000%
"""


def make_llama(tmp_path):
    return llama_lookup.LlamaLookup(
        lookup=tmp_path / "llama-lookup",
        speculative=tmp_path / "llama-speculative-simple",
        gguf=tmp_path / "m.gguf",
        threads=2,
        flash_attn="off",
        context=4096,
    )


def test_a_lookup_report_gives_its_tokens_seconds_and_acceptance():
    assert llama_lookup.parse_output(LOOKUP_REPORT) == llama_lookup.LlamaRun(
        prompt_tokens=1531, decode_tokens=129, decode_seconds=0.911, drafted=215, accepted=97
    )


def test_a_speculative_simple_report_parses_the_same_way():
    assert llama_lookup.parse_output(SPECULATIVE_REPORT) == llama_lookup.LlamaRun(
        prompt_tokens=212, decode_tokens=130, decode_seconds=1.48, drafted=40, accepted=12
    )


def test_a_report_without_its_decode_line_is_an_error_naming_the_line():
    broken = LOOKUP_REPORT.replace("decoded  129 tokens", "decoded tokens")
    with pytest.raises(ValueError, match="decoded N tokens in S seconds"):
        llama_lookup.parse_output(broken)


def test_the_plain_side_is_llama_lookup_drafting_nothing(tmp_path):
    command = llama_lookup.build_command(make_llama(tmp_path), "plain", "hi\n", 128, 5, 3)
    assert command == [
        str(tmp_path / "llama-lookup"), "-m", str(tmp_path / "m.gguf"), "-t", "2", "-tb", "2",
        "-c", "4096", "-fa", "off", "-n", "128", "--ignore-eos", "--temp", "0", "--top-k", "1",
        "--seed", "0", "--no-escape", "-p", "hi\n", "--spec-draft-n-max", "0",
    ]  # fmt: skip


def test_the_lookup_side_drafts_the_given_length(tmp_path):
    command = llama_lookup.build_command(make_llama(tmp_path), "lookup", "hi", 64, 5, 3)
    assert command[0] == str(tmp_path / "llama-lookup")
    assert command[-2:] == ["--spec-draft-n-max", "5"]


def test_the_ngram_simple_side_matches_the_ngram_and_drafts_the_given_length(tmp_path):
    command = llama_lookup.build_command(make_llama(tmp_path), "ngram-simple", "hi", 64, 5, 3)
    assert command[0] == str(tmp_path / "llama-speculative-simple")
    assert command[-6:] == [
        "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "5",
    ]  # fmt: skip


def test_an_unknown_side_is_refused(tmp_path):
    with pytest.raises(ValueError, match="side: 'lookahead'"):
        llama_lookup.build_command(make_llama(tmp_path), "lookahead", "hi", 64, 5, 3)


def test_totals_sum_every_prompt_before_dividing():
    runs = [
        llama_lookup.LlamaRun(
            prompt_tokens=10, decode_tokens=100, decode_seconds=1.0, drafted=50, accepted=40
        ),
        llama_lookup.LlamaRun(prompt_tokens=10, decode_tokens=100, decode_seconds=3.0, drafted=0, accepted=0),
    ]
    totals = llama_lookup.totals(runs)
    assert totals.tok_s == 50.0
    assert totals.acceptance_rate == 0.8
    assert totals.tokens_per_forward == 200 / 160


def test_from_env_names_the_missing_gguf(tmp_path, monkeypatch):
    lookup = tmp_path / "llama-lookup"
    lookup.write_text("")
    (tmp_path / "llama-speculative-simple").write_text("")
    monkeypatch.setenv("LLAMA_LOOKUP", str(lookup))
    monkeypatch.setenv("LLAMA_LOOKUP_GGUF", str(tmp_path / "absent.gguf"))
    with pytest.raises(SystemExit, match="LLAMA_LOOKUP_GGUF"):
        llama_lookup.from_env(2, "off", 4096)


def test_from_env_is_none_without_llama_lookup(monkeypatch):
    monkeypatch.delenv("LLAMA_LOOKUP", raising=False)
    assert llama_lookup.from_env(2, "off", 4096) is None

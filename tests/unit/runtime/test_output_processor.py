"""The output processor on its own: each new token's text, the stop conditions (EOS, stop tokens,
stop strings, length, grammar) and the outputs they make, without a model or an engine.

The tokenizer is byte-level: these texts are one token per byte, so a multi-byte character comes in
pieces and the expected text of every step can be written out.
"""

from __future__ import annotations

import itertools

import pytest

from kunlun_runtime.engine.logprobs import TokenLogprob
from kunlun_runtime.engine.output_processor import OutputProcessor, RequestState
from kunlun_runtime.engine.outputs import RequestOutput
from kunlun_runtime.engine.request import Request, RequestStatus
from kunlun_runtime.engine.sampling_params import SamplingParams
from kunlun_runtime.models.tokenizer import Tokenizer
from tests.support.tiny_models import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    build_tokenizer().save(str(directory / "tokenizer.json"))
    return Tokenizer(directory)


@pytest.fixture(scope="module")
def eos_id(tokenizer):
    return tokenizer.encode("<|im_end|>", add_special_tokens=False)[0]


@pytest.fixture
def processor(tokenizer, eos_id):
    return OutputProcessor(tokenizer, {eos_id})


def make_state(processor, tokenizer, params=None, max_tokens=32, prompt="x") -> RequestState:
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    request = Request("r", prompt_ids, params or SamplingParams(), len(prompt_ids) + max_tokens)
    return processor.new_state(request, prompt)


def feed(processor, state, token_ids) -> list[RequestOutput]:
    """What the engine does with each sampled token: record it, then process it; stops at a finish."""
    outputs = []
    for token_id in token_ids:
        state.request.output_token_ids.append(token_id)
        status = processor.process_token(state, token_id)
        if status is not None:
            outputs.append(processor.finish(state, status, [token_id]))
            break
        outputs.append(processor.make_output(state, [token_id]))
    return outputs


def texts(outputs):
    return [out.outputs[0].text for out in outputs]


def test_text_grows_by_whole_characters_and_the_length_limit_releases_the_rest(processor, tokenizer):
    ids = tokenizer.encode("aé中b", add_special_tokens=False)
    assert len(ids) == 1 + 2 + 3 + 1
    state = make_state(processor, tokenizer, max_tokens=len(ids))
    outputs = feed(processor, state, ids)
    assert texts(outputs) == ["a", "a", "aé", "aé", "aé", "aé中", "aé中b"]
    assert [out.outputs[0].finish_reason for out in outputs] == [None] * 6 + ["length"]
    assert [out.finished for out in outputs] == [False] * 6 + [True]
    assert [out.new_token_ids for out in outputs] == [[t] for t in ids]
    assert outputs[-1].outputs[0].token_ids == ids and outputs[-1].outputs[0].stop_reason is None
    assert outputs[-1].times.finished is not None and outputs[0].prompt == "x"


def test_a_length_finish_releases_even_half_a_character(processor, tokenizer):
    ids = tokenizer.encode("a中", add_special_tokens=False)[:2]
    outputs = feed(processor, make_state(processor, tokenizer, max_tokens=2), ids)
    assert texts(outputs) == ["a", "a\ufffd"]
    assert outputs[-1].outputs[0].finish_reason == "length"


def test_a_stop_string_is_held_back_while_it_could_start_and_cut_when_it_completes(processor, tokenizer):
    ids = tokenizer.encode("abSTOcd", add_special_tokens=False)
    state = make_state(processor, tokenizer, SamplingParams(stop=["STO"]))
    outputs = feed(processor, state, ids)
    assert texts(outputs) == ["", "", "a", "ab", "ab"]  # "STO" less one character held back
    final = outputs[-1].outputs[0]
    assert (final.finish_reason, final.stop_reason) == ("stop", "STO")
    assert final.token_ids == ids[:5]  # nothing after the token that completed it


def test_include_stop_str_in_output_keeps_the_stop_string(processor, tokenizer):
    ids = tokenizer.encode("abSTOcd", add_special_tokens=False)
    params = SamplingParams(stop=["STO"], include_stop_str_in_output=True)
    outputs = feed(processor, make_state(processor, tokenizer, params), ids)
    assert outputs[-1].outputs[0].text == "abSTO" and outputs[-1].outputs[0].stop_reason == "STO"


def test_a_stop_string_over_several_tokens_ends_at_its_last_token(processor, tokenizer):
    ids = tokenizer.encode("xyzab", add_special_tokens=False)
    outputs = feed(processor, make_state(processor, tokenizer, SamplingParams(stop=["zab", "q"])), ids)
    assert texts(outputs) == ["", "", "x", "xy", "xy"]  # the longest stop string less one held back
    assert outputs[-1].outputs[0].stop_reason == "zab"


def test_a_stop_token_ends_the_request_with_its_text_and_id(processor, tokenizer):
    ids = tokenizer.encode("abcd", add_special_tokens=False)
    outputs = feed(processor, make_state(processor, tokenizer, SamplingParams(stop_token_ids=[ids[2]])), ids)
    final = outputs[-1].outputs[0]
    assert (final.text, final.finish_reason, final.stop_reason) == ("abc", "stop", ids[2])
    assert len(outputs) == 3


def test_eos_stops_unless_ignored_and_not_before_min_tokens(processor, tokenizer, eos_id):
    a, b = tokenizer.encode("ab", add_special_tokens=False)
    stopped = feed(processor, make_state(processor, tokenizer), [a, eos_id, b])
    assert len(stopped) == 2
    final = stopped[-1].outputs[0]
    assert (final.text, final.finish_reason, final.stop_reason) == ("a", "stop", None)  # special skipped
    ignored = feed(
        processor, make_state(processor, tokenizer, SamplingParams(ignore_eos=True)), [a, eos_id, b]
    )
    assert [out.finished for out in ignored] == [False, False, False]
    early = feed(
        processor, make_state(processor, tokenizer, SamplingParams(min_tokens=3)), [a, eos_id, b, eos_id]
    )
    assert [out.finished for out in early] == [False, False, False, True]


def test_min_tokens_defers_stop_tokens(processor, tokenizer):
    (a,) = tokenizer.encode("a", add_special_tokens=False)
    outputs = feed(
        processor, make_state(processor, tokenizer, SamplingParams(min_tokens=3, stop_token_ids=[a])), [a] * 4
    )
    assert [out.finished for out in outputs] == [False, False, True]
    assert (outputs[-1].outputs[0].text, outputs[-1].outputs[0].stop_reason) == ("aaa", a)


def test_max_tokens_is_the_budget_the_outputs_report_and_end_at(processor, tokenizer):
    ids = tokenizer.encode("abcdef", add_special_tokens=False)
    outputs = feed(processor, make_state(processor, tokenizer, max_tokens=3), ids)
    assert [out.max_tokens for out in outputs] == [3, 3, 3]
    assert [out.outputs[0].finish_reason for out in outputs] == [None, None, "length"]


def test_an_abort_releases_the_held_back_text(processor, tokenizer):
    state = make_state(processor, tokenizer, SamplingParams(stop=["STO"]))
    running = feed(processor, state, tokenizer.encode("abcST", add_special_tokens=False))
    assert texts(running) == ["", "", "a", "ab", "abc"]
    aborted = processor.finish(state, RequestStatus.FINISHED_ABORTED)
    assert (aborted.outputs[0].text, aborted.outputs[0].finish_reason) == ("abcST", "abort")
    assert aborted.new_token_ids == [] and aborted.finished


def test_a_grammar_end_decides_before_every_other_condition(processor, tokenizer, eos_id):
    state = make_state(processor, tokenizer)
    state.grammar_end = RequestStatus.FINISHED_ABORTED
    state.request.output_token_ids.append(eos_id)
    assert processor.process_token(state, eos_id) is RequestStatus.FINISHED_ABORTED


def test_logprobs_are_reported_only_when_asked_with_their_sum(processor, tokenizer):
    a, b = tokenizer.encode("ab", add_special_tokens=False)
    for asked, expected in ((1, [-0.5, -0.25]), (None, None)):
        state = make_state(processor, tokenizer, SamplingParams(logprobs=asked))
        for token_id, value in ((a, -0.5), (b, -0.25)):
            state.request.output_logprobs.append(TokenLogprob(token_id, value, 1, ((token_id, value),)))
        out = feed(processor, state, [a, b])[-1].outputs[0]
        assert (None if out.logprobs is None else [lp.logprob for lp in out.logprobs]) == expected
        assert out.cumulative_logprob == (-0.75 if asked else None)


@pytest.mark.parametrize("stop", [["STOP"], ["STOP", "x"], ["a long stop string"]])
def test_released_text_only_grows_while_a_stop_string_is_held_back(processor, tokenizer, stop) -> None:
    # A stream sends each step's text past what it sent before (server/chat.py, completions.py):
    # that is only the output if every step's text is a prefix of the next one. While the text is
    # shorter than the hold, nothing is released (not the text less a negative count from its end).
    state = make_state(processor, tokenizer, SamplingParams(stop=stop))
    outs = texts(feed(processor, state, tokenizer.encode("abcdefgh", add_special_tokens=False)))
    outs.append(processor.finish(state, RequestStatus.FINISHED_LENGTH).outputs[0].text)
    for before, after in itertools.pairwise(outs):
        assert after.startswith(before), outs
    streamed, sent = "", 0
    for text in outs:
        streamed, sent = streamed + text[sent:], len(text)
    assert streamed == outs[-1] == "abcdefgh"

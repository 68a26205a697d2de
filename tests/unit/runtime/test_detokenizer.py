"""Incremental detokenization never splits a multi-byte character and ends equal to a full decode."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kunlun_runtime.engine.detokenizer import IncrementalDetokenizer
from kunlun_runtime.models.tokenizer import Tokenizer
from tests.support.tiny_models import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    build_tokenizer().save(str(directory / "tokenizer.json"))
    return Tokenizer(directory)


def test_multibyte_characters_are_released_only_when_complete(tokenizer):
    ids = tokenizer.encode("é中🙂", add_special_tokens=False)
    assert len(ids) == 2 + 3 + 4  # byte-level: one token per UTF-8 byte
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = [detok.add(token_id) for token_id in ids]
    assert deltas == ["", "é", "", "", "中", "", "", "", "🙂"]
    assert all("\ufffd" not in delta for delta in deltas)


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab é中🙂\n")), min_size=1, max_size=30))
def test_concatenated_deltas_equal_the_full_decode(tokenizer, text):
    prompt = tokenizer.encode("the ", add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    streamed = "".join(detok.add(token_id) for token_id in ids) + detok.flush()
    assert streamed == tokenizer.decode(ids) == text
    assert detok.text == text


def test_flush_releases_a_dangling_partial_character(tokenizer):
    ids = tokenizer.encode("中", add_special_tokens=False)[:2]
    detok = IncrementalDetokenizer(tokenizer, [])
    assert [detok.add(t) for t in ids] == ["", ""]
    assert detok.flush() == "\ufffd"

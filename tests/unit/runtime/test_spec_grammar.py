"""Speculative decoding under a grammar, on the real grammar engine and a byte-level vocabulary
(one token per character here): drafts are cut at the first token the grammar refuses, each
position is masked by the grammar's state after the drafts before it, the matcher ends where it
began, and verification picks (greedy) or samples (keeping the distribution exactly) among the
allowed tokens only."""

import numpy as np
import pytest
import torch

from kunlun_runtime.config import SpeculativeConfig
from kunlun_runtime.engine.request import Request
from kunlun_runtime.engine.sampler import AllowedTokens, Sampler
from kunlun_runtime.engine.sampling_params import SamplingParams
from kunlun_runtime.engine.spec_decode import SpeculativeDecoder
from kunlun_runtime.engine.spec_grammar import grammar_drafts
from kunlun_runtime.structured.grammar import GrammarCompiler
from kunlun_runtime.structured.params import StructuredOutputsParams
from tests.support.tiny_models import VOCAB_SIZE, build_tokenizer

TOKENIZER = build_tokenizer()
EOS = TOKENIZER.token_to_id("<|im_end|>")
DIGITS = r"[0-9]{3}-[a-z]{2}"
# The 0.1 % critical value of chi-square for 3 degrees of freedom.
CHI2_CRITICAL_3 = 16.27


def ids(text):
    return TOKENIZER.encode(text).ids


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(TOKENIZER.to_str(), VOCAB_SIZE, [EOS])


def matcher(compiler, consumed="", **constraint):
    grammar = compiler.new_matcher(StructuredOutputsParams(**constraint))
    for token in ids(consumed):
        assert grammar.accept(token)
    return grammar


def allowed_set(row):
    return {t for t in range(VOCAB_SIZE) if (int(row[t // 32]) >> (t % 32)) & 1}


def test_drafts_are_cut_at_the_first_token_the_grammar_refuses(compiler):
    grammar = matcher(compiler, "12", regex=DIGITS)
    before = compiler.fill_bitmask([grammar])
    assert grammar_drafts(grammar, ids("3-x9z")) == ids("3-x")  # a digit after the dash is refused
    assert grammar_drafts(grammar, ids("#3")) == []
    assert grammar_drafts(grammar, ids("3-ab")) == ids("3-ab")
    assert grammar_drafts(None, ids("#3")) == ids("#3")  # a request without a grammar
    assert np.array_equal(compiler.fill_bitmask([grammar]), before)  # the state is unchanged
    assert grammar.accept(ids("3")[0]) and not grammar.accept(ids("x")[0])


def test_each_position_gets_the_mask_of_the_grammar_after_the_drafts_before_it(compiler):
    grammar = matcher(compiler, "1", regex=DIGITS)
    other = matcher(compiler, "", choice=["yes", "no"])  # no drafts, in the same call
    drafts = ids("23-a")
    before = compiler.fill_bitmask([grammar])
    bitmask = compiler.fill_bitmask([other, grammar], [[], drafts])
    assert bitmask.shape[0] == 1 + 1 + len(drafts)
    assert np.array_equal(bitmask[0], compiler.fill_bitmask([other])[0])
    for position in range(len(drafts) + 1):
        after = matcher(compiler, "1", regex=DIGITS)
        for token in drafts[:position]:
            assert after.accept(token)
        assert np.array_equal(bitmask[1 + position], compiler.fill_bitmask([after])[0]), position
    assert np.array_equal(compiler.fill_bitmask([grammar]), before)  # rolled back: where it began
    assert grammar.validate(drafts) == len(drafts)


def test_after_a_draft_that_completes_the_grammar_only_eos_then_nothing(compiler):
    grammar = matcher(compiler, "", choice=["ab"])
    drafts = [*ids("ab"), EOS]
    assert grammar_drafts(grammar, [*drafts, *ids("c")]) == drafts  # nothing after the end
    bitmask = compiler.fill_bitmask([grammar], [drafts])
    assert [allowed_set(row) for row in bitmask] == [set(ids("a")), set(ids("b")), {EOS}, set()]
    assert not grammar.is_finished and grammar.validate(ids("ab")) == 2


def _logits(favoured, rows):
    """Logits [len(favoured), V] whose largest value at row i is the forbidden '#', then the
    token ``favoured[i]``."""
    logits = torch.zeros(rows, VOCAB_SIZE)
    logits[:, ids("#")[0]] = 50.0
    for row, token in enumerate(favoured):
        logits[row, token] = 10.0
    return logits


@pytest.mark.parametrize("logprobs", [None, 1])  # the batched argmax, and verify()
def test_greedy_verification_takes_the_masked_argmax_and_does_not_advance_the_grammar(compiler, logprobs):
    spec = SpeculativeDecoder(SpeculativeConfig(num_speculative_tokens=3), [EOS])
    sampler = Sampler([EOS])
    plain_grammar = matcher(compiler, "", choice=["yes", "no"])
    grammar = matcher(compiler, "1", regex=DIGITS)
    plain = Request("plain", [5], SamplingParams(temperature=0), max_total_tokens=64)
    drafted = Request("drafted", [5], SamplingParams(temperature=0, logprobs=logprobs), max_total_tokens=64)
    drafted.spec_token_ids = ids("23-")
    # The model agrees with "2", "3" and "-" only under the mask ("9" and "#" are likelier), and
    # after them prefers "9", "-" and "#" to the "q" the grammar allows.
    logits = torch.cat([_logits(ids("n"), 1), _logits(ids("239"), 3), _logits(ids("-"), 1)])
    logits[4, ids("9")[0]] = 12.0
    logits[4, ids("q")[0]] = 5.0
    before = compiler.fill_bitmask([grammar])
    bitmask = compiler.fill_bitmask([plain_grammar, grammar], [[], drafted.spec_token_ids])
    allowed = AllowedTokens(tuple(range(5)), bitmask)
    results = spec.sample(sampler, logits, [1, 4], [plain, drafted], allowed)
    assert [t for t, _ in results[0]] == ids("n")
    assert [t for t, _ in results[1]] == ids("23-q")  # every draft, then the masked bonus
    assert spec.counters.num_accepted_tokens == 3
    if logprobs is not None:  # after the mask: the chosen token's among the allowed only
        masked = torch.full((VOCAB_SIZE,), float("-inf"))
        masked[[ids(digit)[0] for digit in "0123456789"]] = 0.0
        masked[ids("2")[0]] = 10.0
        expected = torch.log_softmax(masked, -1)[ids("2")[0]]
        assert results[1][0][1].logprob == pytest.approx(float(expected), abs=1e-5)
    assert np.array_equal(compiler.fill_bitmask([grammar]), before)  # the engine advances it, not this


def test_a_draft_the_model_rejects_is_replaced_by_its_masked_choice(compiler):
    spec = SpeculativeDecoder(SpeculativeConfig(num_speculative_tokens=3), [EOS])
    grammar = matcher(compiler, "", regex=DIGITS)
    request = Request("r", [5], SamplingParams(temperature=0), max_total_tokens=64)
    request.spec_token_ids = ids("45")
    logits = _logits(ids("478"), 3)  # the model wants "7" where the draft says "5"
    allowed = AllowedTokens((0, 1, 2), compiler.fill_bitmask([grammar], [request.spec_token_ids]))
    [emitted] = spec.sample(Sampler([EOS]), logits, [3], [request], allowed)
    assert [t for t, _ in emitted] == ids("47")
    assert spec.counters.num_accepted_tokens == 1


def _chi_square(counts, probs):
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_sampled_verification_keeps_the_masked_distribution(compiler):
    """The first token follows the masked p0 whatever the draft; after an accepted draft the next
    follows the masked p1, though the model puts nearly all its mass on a forbidden token."""
    grammar = matcher(compiler, "", regex=r"[0-3]{2}")
    digits = ids("0123")
    draft = ids("1")
    logits = torch.zeros(2, VOCAB_SIZE)
    logits[:, ids("#")[0]] = 20.0
    logits[0, digits] = torch.tensor([1.0, 0.5, 0.0, -0.5])
    logits[1, digits] = torch.tensor([-1.0, 0.0, 1.0, 0.3])
    p0, p1 = (torch.softmax(logits[row, digits].double(), -1) for row in (0, 1))
    allowed = AllowedTokens((0, 1), compiler.fill_bitmask([grammar], [draft]))
    spec = SpeculativeDecoder(SpeculativeConfig(num_speculative_tokens=1), [EOS])
    sampler = Sampler([EOS])
    first = torch.zeros(4, dtype=torch.float64)
    second = torch.zeros(4, dtype=torch.float64)
    draws = 8000
    for seed in range(draws):
        request = Request(f"r{seed}", [5], SamplingParams(temperature=1.0, seed=seed), max_total_tokens=64)
        request.spec_token_ids = list(draft)
        [emitted] = spec.sample(sampler, logits, [2], [request], allowed)
        sampler.forget(request.request_id)
        first[digits.index(emitted[0][0])] += 1
        if len(emitted) == 2:
            second[digits.index(emitted[1][0])] += 1
    assert _chi_square(first, p0) < CHI2_CRITICAL_3
    assert second.sum() > 0.9 * float(p0[1]) * draws  # accepted about p0(draft) of the time
    assert _chi_square(second, p1) < CHI2_CRITICAL_3

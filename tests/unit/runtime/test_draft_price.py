"""The draft-row price from adjacent decode steps of the same requests (engine/draft_price.py)."""

import pytest

from kunlun_runtime.engine.draft_price import MIN_ROWS, PRICE_STEPS, SAMPLES, DraftRowPrice

BATCH = frozenset(f"r{i}" for i in range(8))
OTHER = frozenset(f"s{i}" for i in range(8))


def _ms(series):
    return [round(seconds * 1e3, 6) for seconds in series]


def test_a_draft_row_costs_what_a_step_with_drafts_adds_to_the_steps_without():
    price = DraftRowPrice()
    assert price.series(BATCH, 2) is None  # nothing seen of these requests
    price.observe(BATCH, 0, 0.020)
    price.observe(BATCH, 0, 0.022)  # the plain step: their mean, recent ones weighted more
    assert _ms(price.series(BATCH, 2)) == [21.0, 21.0, 21.0]  # never paired: drafts run, priced 0
    price.observe(BATCH, 4, 0.029)  # 8 ms more for 4 drafts
    assert MIN_ROWS > 4 and _ms(price.series(BATCH, 2)) == [21.0, 21.0, 21.0]  # too few rows to price
    price.observe(BATCH, 4, 0.029)
    assert _ms(price.series(BATCH, 3)) == [21.0, 23.0, 25.0, 27.0]


def test_one_noisy_pair_of_few_drafts_does_not_set_the_price():
    price = DraftRowPrice()
    price.observe(BATCH, 0, 0.030)
    price.observe(BATCH, 1, 0.0357)  # one draft, and the step 5.7 ms slower: mostly noise
    assert _ms(price.series(BATCH, 2)) == [30.0, 30.0, 30.0]  # unpriced: the drafts run
    assert not price.wants_probe(BATCH, 1)  # its plain step is known: pairs come without probes
    price.observe(BATCH, 7, 0.0405)  # seven drafts at 1.5 ms outweigh the one
    assert _ms(price.series(BATCH, 2)) == [30.0, 31.5, 33.0]


def test_one_slow_step_does_not_set_the_price():
    price = DraftRowPrice()
    price.observe(BATCH, 0, 0.020)
    for _ in range(SAMPLES - 1):
        price.observe(BATCH, 2, 0.024)
    price.observe(BATCH, 2, 0.120)  # another tenant took the cores for 100 ms
    assert _ms(price.series(BATCH, 1)) == [20.0, 22.0]


def test_the_price_holds_for_as_many_requests_and_the_plain_step_for_the_same_ones():
    price = DraftRowPrice()
    price.observe(BATCH, 0, 0.020)
    price.observe(BATCH, 8, 0.036)
    price.observe(OTHER, 2, 0.040)  # no plain step of these yet: not a pair
    assert _ms(price.series(OTHER, 1)) == [36.0, 38.0]  # eight requests' price; the step less its drafts
    assert price.series(BATCH, 1) is None  # the latest batch is another: its plain step is not known
    price.observe(OTHER, 0, 0.030)
    assert _ms(price.series(OTHER, 1)) == [30.0, 32.0]  # eight requests' price, OTHER's own step
    one = frozenset({"r0"})
    price.observe(one, 0, 0.012)
    assert _ms(price.series(one, 1)) == [12.0, 12.0]  # beside one request a row was never priced


@pytest.mark.parametrize("seconds", [-0.001, float("nan"), float("inf")])
def test_a_clock_glitch_is_ignored(seconds):
    price = DraftRowPrice()
    price.observe(BATCH, 0, 0.020)
    price.observe(BATCH, 2, seconds)
    price.observe(BATCH, 0, seconds)
    assert _ms(price.series(BATCH, 1)) == [20.0, 20.0]


def test_drafts_never_make_a_step_cheaper():
    price = DraftRowPrice()
    price.observe(BATCH, 0, 0.020)
    price.observe(BATCH, 4, 0.018)  # noise: faster with drafts
    assert _ms(price.series(BATCH, 2)) == [20.0, 20.0, 20.0]


def test_a_batch_that_drafts_every_step_is_priced_by_its_steps_with_different_drafts():
    price = DraftRowPrice()
    price.observe(BATCH, 4, 0.030)
    assert price.series(BATCH, 1) is None  # one step with drafts: neither its price nor its plain step
    price.observe(BATCH, 6, 0.034)  # two more rows, 4 ms more
    assert price.series(BATCH, 1) is None  # two rows measured: too few
    price.observe(BATCH, 12, 0.046)  # six more rows at 2 ms
    # A row at 2 ms; the plain step is the latest step less its drafts.
    assert _ms(price.series(BATCH, 2)) == [22.0, 24.0, 26.0]
    price.observe(BATCH, 4, 0.036)  # eight fewer rows, 10 ms less: 1.25 ms, counted eight times
    assert _ms(price.series(BATCH, 1)) == [31.0, 32.25]
    price.observe(OTHER, 8, 0.040)  # as many requests: their price holds, their step is their own
    assert _ms(price.series(OTHER, 1)) == [40.0 - 8 * 1.25, 40.0 - 7 * 1.25]


def test_an_unpriced_batch_drafting_as_many_rows_each_step_is_asked_for_fewer():
    price = DraftRowPrice()
    price.observe(BATCH, 8, 0.040)
    price.observe(BATCH, 8, 0.041)
    assert not price.wants_probe(BATCH, 8)  # two steps alike: not yet
    price.observe(BATCH, 8, 0.040)
    assert price.wants_probe(BATCH, 8)
    assert not price.wants_probe(BATCH, 6)  # a step with other drafts pairs anyway
    assert not price.wants_probe(OTHER, 8)
    price.observe(BATCH, 7, 0.038)  # one fewer: a pair of one row, too few to price
    price.observe(BATCH, 8, 0.040)
    price.observe(BATCH, 8, 0.040)
    price.observe(BATCH, 8, 0.040)
    assert price.wants_probe(BATCH, 8) and price.series(BATCH, 1) is None
    price.observe(BATCH, 4, 0.032)  # half: the steps down and back up pair 4 rows each
    price.observe(BATCH, 8, 0.040)
    assert _ms(price.series(BATCH, 1)) == [24.0, 26.0]
    price.observe(BATCH, 8, 0.040)
    price.observe(BATCH, 8, 0.040)
    assert not price.wants_probe(BATCH, 8)


def test_a_batch_with_a_plain_step_is_never_probed():
    price = DraftRowPrice()
    price.observe(BATCH, 0, 0.020)
    for _ in range(4):
        price.observe(BATCH, 3, 0.026)
    assert not price.wants_probe(BATCH, 3)


def test_a_price_expires_after_price_steps_without_pairs():
    price = DraftRowPrice()
    price.observe(BATCH, 0, 0.020)
    price.observe(BATCH, 8, 0.060)  # a busy spell: 5 ms a row
    assert _ms(price.series(BATCH, 1)) == [20.0, 25.0]
    for _ in range(PRICE_STEPS - 1):  # refused: plain steps only, nothing pairs
        price.observe(BATCH, 0, 0.020)
    assert _ms(price.series(BATCH, 1)) == [20.0, 25.0]  # the pair is PRICE_STEPS - 1 steps old
    price.observe(OTHER, 0, 0.020)  # as many requests: their steps age the pair too
    assert _ms(price.series(OTHER, 1)) == [20.0, 20.0]  # expired: drafts run unpriced
    price.observe(OTHER, 8, 0.036)  # and are priced afresh
    assert _ms(price.series(OTHER, 1)) == [20.0, 22.0]


def test_pairs_beside_other_numbers_of_requests_do_not_age_a_price():
    price = DraftRowPrice()
    price.observe(BATCH, 0, 0.020)
    price.observe(BATCH, 8, 0.036)
    one = frozenset({"r0"})
    for _ in range(PRICE_STEPS):
        price.observe(one, 0, 0.010)
    price.observe(BATCH, 0, 0.020)
    assert _ms(price.series(BATCH, 1)) == [20.0, 22.0]

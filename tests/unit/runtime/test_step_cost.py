"""The online step-time model: features of a batch, an exact fit on noise-free synthetic steps,
the sliding window following a change, non-negative slopes, and input that is not data."""

import random

import pytest

from kunlun_runtime.engine.step_cost import (
    StepCostModel,
    StepFeatures,
    batch_features,
    chunk_features,
    decode_features,
    draft_row_features,
)

# intercept, per prefill token, per decode, per attended token, once for a step with any prefill,
# per draft row, per token a draft row attends
TRUE = (0.002, 1e-5, 3e-4, 1e-8, 0.004, 1e-4, 2e-9)


def synthetic_seconds(features, coefficients=TRUE):
    return sum(c * x for c, x in zip(coefficients, features.row(), strict=True))


def random_features(rng):
    prefill = rng.randint(1, 2048) if rng.random() < 0.6 else 0  # pure-decode steps too
    drafts = 0 if prefill else rng.randint(0, 16)  # the draft terms are pure decode steps'
    return StepFeatures(
        prefill, rng.randint(0, 64), rng.randint(0, 4_000_000), drafts, drafts * rng.randint(1, 4096)
    )


def test_a_one_token_chunk_is_a_decode_and_a_longer_one_is_prefill():
    assert chunk_features(10, 1) == StepFeatures(0, 1, 11)
    assert chunk_features(16, 8) == StepFeatures(8, 0, 8 * 24)
    assert chunk_features(5, 0) == StepFeatures()
    assert draft_row_features(10) == StepFeatures(0, 0, 0, 1, 11)  # a row whose keys are its decode row's
    # A decode with 2 drafts: its own row (11 keys), then draft rows attending 12 and 13 keys.
    assert decode_features(10, 2) == StepFeatures(0, 1, 11, 2, 12 + 13)
    assert decode_features(10, 0) == chunk_features(10, 1)


def test_batch_features_sum_over_the_chunks():
    expected = StepFeatures(128, 2, 100 * 100 + 41 + 8 + 28 * 128)
    assert batch_features([(0, 100), (40, 1), (7, 1), (100, 28)]) == expected
    assert batch_features([]) == StepFeatures()


def test_nothing_is_predicted_before_the_first_observation():
    model = StepCostModel()
    assert model.coefficients is None
    assert model.predict(StepFeatures(10, 1, 10)) is None


def test_noise_free_steps_recover_the_coefficients_exactly():
    model, rng = StepCostModel(), random.Random(0)
    for _ in range(40):
        features = random_features(rng)
        model.observe(features, synthetic_seconds(features))
    assert model.coefficients == pytest.approx(TRUE, rel=1e-6)
    probe = StepFeatures(512, 16, 300_000)
    assert model.predict(probe) == pytest.approx(0.002 + 512e-5 + 16 * 3e-4 + 300_000e-8 + 0.004, rel=1e-6)
    assert model.predict(StepFeatures(0, 16, 300_000)) == pytest.approx(
        0.002 + 16 * 3e-4 + 300_000e-8, rel=1e-6
    )


def test_the_window_forgets_old_steps_and_follows_a_slower_device():
    model, rng = StepCostModel(window=32), random.Random(1)
    for _ in range(32):
        features = random_features(rng)
        model.observe(features, synthetic_seconds(features))
    slower = tuple(2 * c for c in TRUE)
    for _ in range(32):
        features = random_features(rng)
        model.observe(features, synthetic_seconds(features, slower))
    assert model.num_observations == 32
    assert model.coefficients == pytest.approx(slower, rel=1e-6)


def test_running_sums_stay_exact_over_many_rebuilds():
    model, rng = StepCostModel(window=12), random.Random(2)  # 2 terms over the 6 unknowns
    for _ in range(1000):
        features = random_features(rng)
        model.observe(features, synthetic_seconds(features))
    assert model.coefficients == pytest.approx(TRUE, rel=1e-6)


def test_a_slope_that_fits_negative_is_dropped_and_the_rest_refit():
    # Steps get faster with more decodes in this (noisy-looking) data: the decode term is set to 0
    # and the others are refit without it; nothing in the model ever rewards a bigger batch.
    model = StepCostModel()
    points = [
        (StepFeatures(0, 1, 0), 0.010),
        (StepFeatures(0, 9, 0), 0.002),
        (StepFeatures(100, 0, 0), 0.020),
    ]
    for features, seconds in points * 3:
        model.observe(features, seconds)
    c0, c_prefill, c_decode, c_attend, c_mixed, c_draft_row, c_draft = model.coefficients
    assert (c_decode, c_attend, c_draft_row, c_draft) == (0.0, 0.0, 0.0, 0.0)
    # Least squares of (0.010, 0.002, 0.020) on intercept + prefill (slope and step price, which
    # one prefill size cannot tell apart): intercept = mean of the two decode-only steps, and the
    # prefill step predicted exactly.
    assert c0 == pytest.approx(0.006, rel=1e-6)
    assert c_prefill >= 0 and c_mixed >= 0
    assert model.predict(StepFeatures(100, 0, 0)) == pytest.approx(0.020, rel=1e-6)


def test_only_decodes_seen_still_predicts_them_and_is_monotone():
    model = StepCostModel()
    for _ in range(20):
        model.observe(StepFeatures(0, 8, 800), 0.02)
    assert model.predict(StepFeatures(0, 8, 800)) == pytest.approx(0.02, rel=1e-6)
    bigger = model.predict(StepFeatures(256, 8, 800 + 256 * 256))
    assert bigger >= model.predict(StepFeatures(0, 8, 800))
    assert all(c >= 0.0 for c in model.coefficients)


@pytest.mark.parametrize("bad", [-0.001, float("nan"), float("inf")])
def test_negative_or_non_finite_times_are_not_data(bad):
    model = StepCostModel()
    model.observe(StepFeatures(0, 1, 1), bad)
    assert model.num_observations == 0
    assert model.coefficients is None


def test_a_window_below_one_is_refused():
    with pytest.raises(ValueError, match="window"):
        StepCostModel(window=0)


def test_with_pass_rows_it_learns_the_price_of_each_further_read_of_the_weights():
    # Pure decode steps of 1..16 rows where every row past each 8 starts another pass costing 5 ms
    # (mixed steps pay none: their linears are not the decode kernels). The fit recovers it, and
    # the ninth row is predicted to cost a pass more than the eighth.
    true_pass = 0.005
    model, rng = StepCostModel(pass_rows=8), random.Random(3)
    for _ in range(200):
        features = random_features(rng)
        rows = features.num_decode_seqs + features.num_draft_rows
        passes = -(-rows // 8) - 1 if features.num_prefill_tokens == 0 else 0
        model.observe(features, synthetic_seconds(features) + true_pass * max(passes, 0))
    assert model.coefficients is not None and len(model.coefficients) == 8
    assert model.coefficients[:7] == pytest.approx(TRUE, rel=1e-4, abs=1e-12)
    assert model.coefficients[7] == pytest.approx(true_pass, rel=1e-4)
    eight, nine = StepFeatures(0, 8, 8000), StepFeatures(0, 9, 9000)
    assert model.predict(nine) - model.predict(eight) == pytest.approx(
        3e-4 + 1000 * 1e-8 + true_pass, rel=1e-3
    )
    with pytest.raises(ValueError, match="pass_rows"):
        StepCostModel(pass_rows=0)


def test_draft_rows_in_a_mixed_step_are_priced_as_decode_rows():
    # Mixed steps cost 50 ms more than their parts, and some carry draft rows, which then cost
    # what decode rows do (1 ms, and 1 µs a key); in pure decode steps a draft row costs 0.2 ms
    # and 0.3 µs a key. The draft terms are those, learnt from the pure decode steps.
    model, rng = StepCostModel(), random.Random(5)
    for _ in range(200):
        rows, drafts, context = rng.randint(1, 8), rng.randint(0, 8), rng.randint(100, 2000)
        prefill = rng.choice([0, 0, rng.randint(16, 512)])
        features = StepFeatures(prefill, rows, rows * context + prefill * prefill, drafts, drafts * context)
        seconds = 0.01 + 1e-3 * rows + 1e-6 * (rows * context + prefill * prefill)
        if prefill:
            seconds += 0.05 + 1e-4 * prefill + 1e-3 * drafts + 1e-6 * drafts * context
        else:
            seconds += 2e-4 * drafts + 3e-7 * drafts * context
        model.observe(features, seconds)
    assert model.coefficients == pytest.approx((0.01, 1e-4, 1e-3, 1e-6, 0.05, 2e-4, 3e-7), rel=1e-6)
    mixed = StepFeatures(100, 2, 2 * 1000 + 100 * 100, 1, 1000)
    assert model.predict(mixed) == pytest.approx(model.predict(StepFeatures(100, 3, 3 * 1000 + 100 * 100)))


def test_decode_rows_are_known_while_the_window_holds_pure_decode_steps_of_two_sizes():
    model = StepCostModel(window=3)
    model.observe(StepFeatures(0, 4, 400), 0.01)
    model.observe(StepFeatures(64, 4, 4000), 0.05)  # a mixed step: not a decode size
    assert not model.knows_decode_rows()
    model.observe(StepFeatures(0, 8, 800), 0.02)
    assert model.knows_decode_rows()
    model.observe(StepFeatures(0, 8, 800), 0.02)  # the 4-row step leaves the window
    model.observe(StepFeatures(0, 8, 800), 0.02)
    assert not model.knows_decode_rows()


@pytest.mark.parametrize("pass_rows", [None, 8])
def test_predicting_a_series_of_added_rows_agrees_with_predicting_each(pass_rows):
    # The one-pass series the drafting decision uses must be `predict` of each sum, weight passes
    # and mixed steps (whose draft rows are priced as decode rows) included.
    model, rng = StepCostModel(pass_rows=pass_rows), random.Random(11)
    for _ in range(100):
        features = random_features(rng)
        rows = features.num_decode_seqs + features.num_draft_rows
        passes = -(-rows // 8) - 1 if features.num_prefill_tokens == 0 and rows else 0
        model.observe(features, synthetic_seconds(features) + 0.003 * passes + rng.uniform(0, 1e-3))
    for base in (StepFeatures(0, 6, 6000), StepFeatures(0, 0, 0), StepFeatures(300, 2, 92_000, 1, 900)):
        for added in (draft_row_features(1500), chunk_features(1200, 1)):
            series = model.predict_adding(base, added, 12)
            expected, features = [], base
            for _ in range(13):
                expected.append(model.predict(features))
                features = features + added
            assert series == pytest.approx(expected, rel=1e-12)
    assert StepCostModel().predict_adding(StepFeatures(), draft_row_features(10), 3) is None

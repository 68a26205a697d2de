"""Suffix decoding's tree: its counts and proposals equal a brute-force count over the sequences
it holds, as they grow and as they leave; the limits of min_token_prob and max_spec_factor."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kunlun_runtime.engine.suffix_tree import SuffixTree
from tests.support.suffix_reference import count_nodes, path_counts, reference_draft, substring_counts


def assert_draft(draft, expected):
    tokens, score, match = expected
    assert (draft.token_ids, draft.match_length) == (tokens, match)
    assert abs(draft.score - score) < 1e-9


streams = st.lists(st.integers(0, 3), min_size=1, max_size=50)
knobs = st.tuples(
    st.integers(1, 8), st.sampled_from([0.3, 0.5, 1.0, 2.0]), st.sampled_from([0.0, 0.1, 0.4, 0.7])
)


@settings(max_examples=300, deadline=None)
@given(
    tokens=streams, cuts=st.lists(st.integers(1, 50), max_size=5), max_depth=st.integers(1, 7), knobs=knobs
)
def test_a_growing_stream_proposes_what_the_scan_proposes(tokens, cuts, max_depth, knobs):
    k, factor, min_prob = knobs
    tree, fed = SuffixTree(max_depth), 0
    for cut in sorted({*(min(c, len(tokens)) for c in cuts), len(tokens)}):
        tree.extend(0, tokens[fed:cut])
        fed = cut
        context = tokens[:cut]
        assert_draft(
            tree.propose(context, k, factor, min_prob),
            reference_draft([context], context, max_depth, k, factor, min_prob),
        )
        assert path_counts(tree) == substring_counts([context], max_depth)
        assert tree.num_nodes == count_nodes(tree)


@settings(max_examples=300, deadline=None)
@given(
    sequences=st.lists(streams, min_size=1, max_size=5),
    context=streams,
    max_depth=st.integers(1, 7),
    knobs=knobs,
)
def test_several_sequences_propose_what_the_scan_proposes(sequences, context, max_depth, knobs):
    k, factor, min_prob = knobs
    tree = SuffixTree(max_depth)
    for seq_id, sequence in enumerate(sequences):
        tree.extend(seq_id, sequence)
    assert_draft(
        tree.propose(context, k, factor, min_prob),
        reference_draft(sequences, context, max_depth, k, factor, min_prob),
    )


@settings(max_examples=200, deadline=None)
@given(
    operations=st.lists(st.one_of(streams, st.integers(0, 9)), min_size=1, max_size=14),
    max_depth=st.integers(1, 6),
)
def test_removing_a_sequence_subtracts_exactly_its_counts(operations, max_depth):
    """Sequences come (a list) and go (an index into those held); the tree is then exactly that of
    the sequences held, holds no node at zero, and its nodes stay within their count bound."""
    tree, held, next_id = SuffixTree(max_depth), {}, 0
    for operation in operations:
        if isinstance(operation, int):
            if not held:
                continue
            seq_id = sorted(held)[operation % len(held)]
            tree.remove(seq_id)
            del held[seq_id]
        else:
            tree.extend(next_id, operation)
            held[next_id], next_id = operation, next_id + 1
        sequences = [held[seq_id] for seq_id in sorted(held)]
        counts = path_counts(tree)
        assert counts == substring_counts(sequences, max_depth)
        assert tree.num_nodes == count_nodes(tree) <= 1 + sum(len(s) * max_depth for s in sequences)
        assert tree.root.count == sum(len(s) for s in sequences)
    for seq_id in list(held):
        tree.remove(seq_id)
    assert (tree.num_nodes, tree.root.count, tree.root.children) == (1, 0, {})


def test_text_that_does_not_repeat_costs_a_node_per_token():
    tree = SuffixTree(24)
    tree.extend(0, range(1000))
    assert tree.num_nodes == 1 + 1000  # one tail per suffix, not one node per token and level


def _tree(sequences, max_depth=8):
    tree = SuffixTree(max_depth)
    for seq_id, sequence in enumerate(sequences):
        tree.extend(seq_id, sequence)
    return tree


def test_min_token_prob_bounds_the_product_of_the_conditional_probabilities():
    # After [1]: 2 twice, 5 once (2/3); after [1, 2]: 3 once, 4 once (1/2 each, 3 seen first).
    tree = _tree([[1, 2, 3], [1, 2, 4], [1, 5]])
    draft = tree.propose([9, 1], 8, 8.0, 0.3)
    assert (draft.token_ids, draft.match_length) == ((2, 3), 1)
    assert abs(draft.score - (2 / 3 + 1 / 3)) < 1e-9
    assert tree.propose([9, 1], 8, 8.0, 0.5).token_ids == (2,)  # 2/3 * 1/2 = 1/3 < 0.5
    assert tree.propose([9, 1], 8, 8.0, 0.7).token_ids == ()  # 2/3 < 0.7


def test_max_spec_factor_and_k_bound_the_draft_by_the_match_length():
    tree = _tree([[1, 2, 3, 4, 5, 6, 7, 8]])
    context = [9, 2, 3]  # matches [2, 3]: two tokens
    assert tree.propose(context, 8, 1.0, 0.1).token_ids == (4, 5)
    assert tree.propose(context, 8, 0.5, 0.1).token_ids == (4,)
    assert tree.propose(context, 8, 2.0, 0.1).token_ids == (4, 5, 6, 7)
    assert tree.propose(context, 3, 2.0, 0.1).token_ids == (4, 5, 6)
    assert tree.propose([9, 9], 8, 2.0, 0.0).token_ids == ()  # nothing matches


def test_the_tree_depth_bounds_match_and_draft_together():
    tree = _tree([[1, 2, 3, 4, 5, 6]], max_depth=4)
    draft = tree.propose([1, 2, 3], 8, 4.0, 0.0)  # [1, 2, 3] then one token: 4 deep
    assert (draft.token_ids, draft.match_length) == ((4,), 3)
    assert tree.propose([1, 2, 3, 4], 8, 4.0, 0.0).token_ids == (5,)  # the match is cut to 3


def test_a_sequence_stops_growing_once_another_grows():
    tree = SuffixTree(4)
    tree.extend(0, [1, 2])
    tree.extend(0, [3])  # still the one growing
    tree.extend(1, [1, 2, 4])
    with pytest.raises(ValueError, match="sequence 0 can no longer grow"):
        tree.extend(0, [5])
    assert path_counts(tree) == substring_counts([[1, 2, 3], [1, 2, 4]], 4)

"""A suffix tree with counts over token sequences: the drafts of suffix decoding (arXiv 2411.04975).

Owns every suffix of its sequences, cut to ``max_depth`` tokens, as a path from the root; a node
counts the suffixes that pass through or end at it, i.e. the occurrences of its path. A path only
one suffix has is a *tail*: one node pointing into its sequence rather than a chain of nodes, and
it is materialised a level at a time only when a second suffix walks into it, so text that does
not repeat costs about a node per token rather than one per token and depth level. Sequences grow
token by token (``extend``: work only for the suffixes still inside shared nodes, at most
``max_depth`` of them; one sequence grows at a time) and leave by subtracting exactly their counts
(``remove``), dropping the nodes that reach zero, so what stays is the tree of the sequences that
stay.
Must not: know requests, tenants or the engine; import torch.
Invariant: a node's count is the number of occurrences of its path within the sequences held
(each at most ``max_depth`` tokens long); its children's counts sum to at most its own.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


class _Node:
    """A path's node. ``children`` is None for a tail, whose continuation is the tokens of its one
    occurrence: ``sequence[start + depth:]`` of sequence ``seq_id``, up to ``max_depth``."""

    __slots__ = ("children", "count", "depth", "seq_id", "start")

    def __init__(self, depth: int, seq_id: int, start: int) -> None:
        self.count = 1
        self.depth = depth  # tokens on the path from the root
        self.children: dict[int, _Node] | None = None
        self.seq_id = seq_id
        self.start = start  # where the occurrence begins in its sequence (tails only)


@dataclass(frozen=True, slots=True)
class Draft:
    """A proposal: its tokens, its score (the sum of each token's probability, the product of the
    conditional probabilities along the path up to it), how many context tokens matched, and
    where in the request's tokens its tokens were copied from (the first one's position; -1 where
    they were not copied from one place, as a suffix tree's counts are not)."""

    token_ids: tuple[int, ...] = ()
    score: float = 0.0
    match_length: int = 0
    source: int = -1


NO_DRAFT = Draft()


def draft_limit(k: int, max_spec_factor: float, match_length: int) -> int:
    """At most ``k`` drafts, and at most ``max_spec_factor`` per matched token (rounded up; the
    epsilon keeps 0.1 * 30 from rounding up to 4)."""
    return min(k, math.ceil(max_spec_factor * match_length - 1e-9))


def _by_count(item: tuple[int, _Node]) -> int:
    return item[1].count


class SuffixTree:
    """The suffixes of a set of sequences (ids chosen by the caller), at most ``max_depth`` deep."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node(0, 0, 0)  # never a tail: its seq_id and start are never read
        self.root.count = 0  # the suffixes held
        self.root.children = {}
        self.num_nodes = 1
        self._sequences: dict[int, list[int]] = {}
        self._growing: int | None = None  # the one sequence that may still grow
        # Its suffixes shorter than max_depth that are not in a tail of their own, by start (a tail
        # follows its sequence's growth by itself).
        self._walking: dict[int, _Node] = {}

    @property
    def num_sequences(self) -> int:
        return len(self._sequences)

    def extend(self, seq_id: int, token_ids: Iterable[int]) -> None:
        """Append ``token_ids`` to sequence ``seq_id``, new or the one that grew last (a new one
        ends the growth of that one): each token starts a suffix and extends those that began
        within the last ``max_depth`` tokens. Raises ValueError for a sequence whose growth ended."""
        if seq_id != self._growing:
            if seq_id in self._sequences:
                raise ValueError(f"sequence {seq_id} can no longer grow: another one grew after it")
            self._growing, self._walking = seq_id, {}
        tokens = self._sequences.setdefault(seq_id, [])
        walking = self._walking
        for token in token_ids:
            tokens.append(token)
            end = len(tokens)
            self.root.count += 1
            walking[end - 1] = self.root
            for start, node in list(walking.items()):
                node = self._advance(node, token, start, end, seq_id)
                if node.children is None or end - start >= self.max_depth:
                    del walking[start]  # in its own tail now, or as deep as the tree goes
                else:
                    walking[start] = node

    def remove(self, seq_id: int) -> None:
        """Subtract every suffix of sequence ``seq_id``; nodes left at zero are dropped."""
        tokens = self._sequences.pop(seq_id)
        if seq_id == self._growing:
            self._growing, self._walking = None, {}
        for start in range(len(tokens)):
            self.root.count -= 1
            node = self.root
            for at in range(start, min(start + self.max_depth, len(tokens))):
                children = node.children
                assert children is not None  # a node counting another suffix too is materialised
                child = children[tokens[at]]
                if child.count == 1:  # only this suffix below: the whole branch goes
                    del children[tokens[at]]
                    self.num_nodes -= _branch_size(child)
                    break
                child.count -= 1
                node = child

    def propose(self, context: Sequence[int], k: int, max_spec_factor: float, min_token_prob: float) -> Draft:
        """The draft after ``context``: match its longest suffix (shorter than ``max_depth``) that
        occurs followed by a token, then follow the most frequent continuation (ties: the first
        seen) while the product of the conditional probabilities (child count / parent count) is
        at least ``min_token_prob``, for at most ``draft_limit(k, max_spec_factor, match)``."""
        match = self._longest_match(context)
        if match is None:
            return NO_DRAFT
        match_length, node, extra = match
        limit = draft_limit(k, max_spec_factor, match_length)
        draft: list[int] = []
        score, probability = 0.0, 1.0
        while len(draft) < limit:
            step = self._next(node, extra)
            if step is None:
                break
            token, node, extra, ratio = step
            probability *= ratio
            if probability < min_token_prob:
                break
            draft.append(token)
            score += probability
        return Draft(tuple(draft), score, match_length)

    def _advance(self, node: _Node, token: int, start: int, end: int, seq_id: int) -> _Node:
        """The node of suffix ``start`` (at ``node``, with ``end - 1 - start`` tokens) after
        ``token``: a new tail of its own, or a shared node counted once more."""
        children = node.children
        assert children is not None and node.depth == end - 1 - start  # a walking suffix's node
        child = children.get(token)
        if child is None:
            children[token] = child = _Node(node.depth + 1, seq_id, start)
            self.num_nodes += 1
            return child
        if child.children is None:
            self._split(child)
        child.count += 1
        return child

    def _split(self, tail: _Node) -> None:
        """Materialise ``tail`` one level: another suffix is entering it. Its occurrence goes on
        in a tail one level down, if it goes on: a next token it will ever have is there already,
        since it began before the suffix entering (so it is longer) or its sequence stopped
        growing. So an occurrence inside its own tail never needs to walk again."""
        tokens = self._sequences[tail.seq_id]
        tail.children = {}
        at = tail.start + tail.depth
        if tail.depth < self.max_depth and at < len(tokens):
            tail.children[tokens[at]] = _Node(tail.depth + 1, tail.seq_id, tail.start)
            self.num_nodes += 1

    def _longest_match(self, context: Sequence[int]) -> tuple[int, _Node, int] | None:
        """(length, node, steps into the node's tail) of the longest suffix of ``context`` that
        occurs followed by a token. A suffix that occurs so, shortened from its front, still does:
        the lengths that match are 1..M, so M is found by bisection."""
        low, high = 1, min(len(context), self.max_depth - 1)
        best: tuple[int, _Node, int] | None = None
        while low <= high:
            middle = (low + high) // 2
            place = self._find(context[len(context) - middle :])
            if place is not None and self._next(*place) is not None:
                best = (middle, *place)
                low = middle + 1
            else:
                high = middle - 1
        return best

    def _find(self, path: Sequence[int]) -> tuple[_Node, int] | None:
        """Where ``path`` ends: its node and the steps taken into that node's tail; None if it
        does not occur."""
        node, extra = self.root, 0
        for token in path:
            children = node.children
            if children is None:
                at = node.start + node.depth + extra
                tokens = self._sequences[node.seq_id]
                if at >= len(tokens) or tokens[at] != token or node.depth + extra >= self.max_depth:
                    return None
                extra += 1
            else:
                child = children.get(token)
                if child is None:
                    return None
                node = child
        return node, extra

    def _next(self, node: _Node, extra: int) -> tuple[int, _Node, int, float] | None:
        """The most frequent token after the place (``node``, ``extra``), the place after it and
        its conditional probability; None at ``max_depth`` or where nothing followed."""
        depth = node.depth + extra
        if depth >= self.max_depth:
            return None
        children = node.children
        if children is None:  # in a tail: its one occurrence's next token, if it has come
            tokens = self._sequences[node.seq_id]
            at = node.start + depth
            return None if at >= len(tokens) else (tokens[at], node, extra + 1, 1.0)
        if not children:
            return None
        token, child = max(children.items(), key=_by_count)  # max keeps the first of equals
        return token, child, 0, child.count / node.count


def _branch_size(node: _Node) -> int:
    """The nodes of a branch whose top counts one suffix: a chain (each count 1, one child)."""
    size = 1
    while node.children:
        node = next(iter(node.children.values()))
        size += 1
    return size

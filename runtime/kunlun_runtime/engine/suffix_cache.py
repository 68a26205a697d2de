"""Suffix decoding's drafts for a request: its own suffix tree beside its tenant's tree of the
outputs of earlier requests, whichever proposes the better-scoring draft.

Owns ``SuffixCache`` (the finished requests' outputs, one tree per tenant, at most
``max_cached_requests`` in all, the oldest leaving first with exactly its counts) and
``SuffixIndex`` (one request's tree, extended as its tokens grow). A tenant is the request's
(cache_salt, LoRA adapter): the prefix cache's isolation, so one tenant's text is never proposed
to another. Only outputs are cached, not prompts: a request's own prompt is already in its own
tree; other requests' prompts are text the model read, not the text it writes, and being far
longer than the outputs they would take most of the cache's bounded room.
Must not: know the engine, the scheduler or torch; see a request beyond its tokens and tenant.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from kunlun_runtime.config import SpeculativeConfig
from kunlun_runtime.engine.request import Request
from kunlun_runtime.engine.suffix_tree import NO_DRAFT, Draft, SuffixTree

TenantKey = tuple[str | None, tuple[int, str] | None]  # (cache_salt, LoRA adapter's (id, name))
_OWN = 0  # the one sequence of a request's own tree


def tenant_of(request: Request) -> TenantKey:
    """Whose text ``request`` may be proposed: its cache_salt and adapter, as for the prefix cache."""
    return request.cache_salt, request.lora_key


@dataclass(frozen=True, slots=True)
class SuffixParams:
    """The suffix method's settings (vLLM's ``suffix_decoding_*`` keys)."""

    max_tree_depth: int = 24
    max_cached_requests: int = 10000
    max_spec_factor: float = 1.0
    min_token_prob: float = 0.1

    @classmethod
    def from_config(cls, config: SpeculativeConfig) -> SuffixParams:
        """The settings of a validated ``suffix`` config (ValueError for any other)."""
        depth, cached = config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests
        factor, probability = config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob
        if depth is None or cached is None or factor is None or probability is None:
            raise ValueError(f"not a suffix speculative config: {config!r}")
        return cls(depth, cached, factor, probability)


class SuffixCache:
    """The outputs of finished requests, a suffix tree per tenant; at most ``max_cached_requests``
    outputs in all (0: none), the oldest removed first, and a tenant's tree dropped with its last
    output, so memory follows what is cached."""

    def __init__(self, max_tree_depth: int, max_cached_requests: int) -> None:
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self._trees: dict[TenantKey, SuffixTree] = {}
        self._order: deque[tuple[int, TenantKey]] = deque()  # (sequence id, tenant), oldest first
        self._next_id = 0

    @property
    def num_requests(self) -> int:
        return len(self._order)

    @property
    def num_nodes(self) -> int:
        return sum(tree.num_nodes for tree in self._trees.values())

    def tree(self, tenant: TenantKey) -> SuffixTree | None:
        """``tenant``'s tree; None while it has no cached output."""
        return self._trees.get(tenant)

    def add(self, tenant: TenantKey, output_token_ids: Sequence[int]) -> None:
        """Cache a finished request's output under ``tenant``, first evicting the oldest outputs
        to stay within ``max_cached_requests``. An empty output is not kept."""
        if self.max_cached_requests == 0 or not output_token_ids:
            return
        while len(self._order) >= self.max_cached_requests:
            self._evict_oldest()
        tree = self._trees.get(tenant)
        if tree is None:
            tree = self._trees[tenant] = SuffixTree(self.max_tree_depth)
        seq_id, self._next_id = self._next_id, self._next_id + 1
        tree.extend(seq_id, output_token_ids)
        self._order.append((seq_id, tenant))

    def _evict_oldest(self) -> None:
        seq_id, tenant = self._order.popleft()
        tree = self._trees[tenant]
        tree.remove(seq_id)
        if tree.num_sequences == 0:
            del self._trees[tenant]


class SuffixIndex:
    """One request's drafts: a tree of its own tokens (prompt and output), extended as they grow,
    and its tenant's tree in ``cache``; the draft that scores higher wins (its own on a tie)."""

    def __init__(
        self, params: SuffixParams, cache: SuffixCache | None = None, tenant: TenantKey = (None, None)
    ) -> None:
        self.params = params
        self.cache = cache
        self.tenant = tenant
        self._own = SuffixTree(params.max_tree_depth)
        self._indexed = 0  # tokens in the own tree

    def propose(self, tokens: Sequence[int], k: int) -> Draft:
        """Up to ``k`` drafts to follow ``tokens`` (the request's tokens so far: the ones before
        are those of the last call, then the new ones)."""
        if len(tokens) > self._indexed:
            self._own.extend(_OWN, tokens[self._indexed :])
            self._indexed = len(tokens)
        params = self.params
        context = tokens[max(0, len(tokens) - params.max_tree_depth) :]
        own = self._own.propose(context, k, params.max_spec_factor, params.min_token_prob)
        shared = None if self.cache is None else self.cache.tree(self.tenant)
        other = (
            NO_DRAFT
            if shared is None
            else shared.propose(context, k, params.max_spec_factor, params.min_token_prob)
        )
        return own if own.score >= other.score else other

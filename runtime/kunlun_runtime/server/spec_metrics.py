"""vLLM's speculative-decoding counters: drafts, drafted tokens, accepted tokens, and accepted
tokens per draft position (the acceptance rate is accepted / drafted; the per-position counts say
how far runs of drafts get accepted).

Each is the engine's running total, exposed as it is (a Prometheus counter). Present only with
``--speculative-config``, as in vLLM. Plain numbers only: it never imports the engine;
``StatsRecorder`` feeds it after every engine turn.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from kunlun_runtime.server.metrics import ENGINE_INDEX

SpecTotals = tuple[int, int, int, tuple[int, ...]]  # drafts, draft tokens, accepted, accepted per position
FAMILIES = (
    ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
    ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
    ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
)
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


class SpecDecodeMetrics(Collector):
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self._labels = [model_name, ENGINE_INDEX]
        self._totals: SpecTotals = (0, 0, 0, ())
        registry.register(self)

    def update(self, totals: SpecTotals) -> None:
        self._totals = totals

    def collect(self) -> Iterator[Metric]:
        *scalars, per_position = self._totals
        for (name, documentation), value in zip(FAMILIES, scalars, strict=True):
            family = CounterMetricFamily(name, documentation, labels=["model_name", "engine"])
            family.add_metric(self._labels, value)
            yield family
        family = CounterMetricFamily(
            PER_POSITION, "Accepted tokens per draft position.", labels=["model_name", "engine", "position"]
        )
        for position, value in enumerate(per_position):
            family.add_metric([*self._labels, str(position)], value)
        yield family

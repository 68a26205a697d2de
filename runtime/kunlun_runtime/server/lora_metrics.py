"""``vllm:lora_requests_info``: which LoRA adapters a replica is serving, for the Inference Extension.

The Gateway API Inference Extension's model-server protocol reads adapter affinity from this gauge
as vLLM defines it: labels ``max_lora`` (adapters one batch may hold), ``running_lora_adapters``
and ``waiting_lora_adapters`` (the adapters of running and of waiting requests, comma-separated,
each once, empty when none), and as value the time of the last update in Unix seconds, by which a
reader picks the newest series. vLLM keeps every label set it ever set (one series per
combination, forever); this keeps exactly one, the latest, swapped whole so a scrape never sees
none or half of one. Present only with ``--enable-lora``, as in vLLM.

Plain names and numbers only: it never imports the engine. ``StatsRecorder`` feeds it after every
engine turn.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LORA_REQUESTS_INFO = "vllm:lora_requests_info"
LABELS = ("max_lora", "running_lora_adapters", "waiting_lora_adapters")


def join_adapters(names: Iterable[str]) -> str:
    """Adapter names comma-separated, each once, in the order first seen."""
    return ",".join(dict.fromkeys(names))


def lora_labels(max_loras: int, running: Sequence[str], waiting: Sequence[str]) -> tuple[str, str, str]:
    """The gauge's label values, in ``LABELS`` order."""
    return str(max_loras), join_adapters(running), join_adapters(waiting)


class LoRARequestsInfo(Collector):
    """The gauge as one series: ``update`` replaces its labels and stamps it with the time."""

    def __init__(self, registry: CollectorRegistry, max_loras: int) -> None:
        # (label values, last update in Unix seconds), replaced whole by each update.
        self._series = (lora_labels(max_loras, (), ()), time.time())
        registry.register(self)

    def update(
        self, max_loras: int, running: Sequence[str], waiting: Sequence[str], now: float | None = None
    ) -> None:
        """Record which adapters the running and the waiting requests use, stamped ``now``."""
        self._series = (lora_labels(max_loras, running, waiting), time.time() if now is None else now)

    @property
    def labels(self) -> dict[str, str]:
        return dict(zip(LABELS, self._series[0], strict=True))

    def collect(self) -> Iterator[Metric]:
        values, updated = self._series
        family = GaugeMetricFamily(LORA_REQUESTS_INFO, "Running stats on lora requests.", labels=LABELS)
        family.add_metric(list(values), updated)
        yield family

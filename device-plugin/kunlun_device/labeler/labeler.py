"""`NodeLabeler`: keeps this node's `kunlun.dev/xpu.*` labels true, through the Kubernetes API.

One round reads the cards and versions (from `xpu-smi` or from the device plugin's node snapshot,
any `XpuReader`), GETs the Node, and PATCHes (JSON merge patch) only the owned labels that differ —
`null` removes one. Rounds repeat every `interval_seconds`; a failed round (API error, unreadable
`xpu-smi`, a missing, stale or corrupt snapshot) changes no label and is retried after 1, 2, 4 ...
seconds, capped at `max_backoff_seconds`. A node without `xpu-smi` is labelled as having no card.

Invariant: no request ever names a label outside `kunlun_device.labels.ALL_LABELS`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kubernetes.client import CoreV1Api
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from kunlun_device.errors import XpuError, XpuToolMissingError
from kunlun_device.labeler.values import build_labels, label_patch
from kunlun_device.labels import ALL_LABELS
from kunlun_device.xpu.model import Versions
from kunlun_device.xpu.reader import XpuReader

logger = logging.getLogger(__name__)
MERGE_PATCH = "application/merge-patch+json"


class NodeLabeler:
    """Labels one node."""

    def __init__(self, api: CoreV1Api, node_name: str, source: XpuReader) -> None:
        self.api = api
        self.node_name = node_name
        self.source = source
        self.patches = 0

    def desired(self) -> dict[str, str | None]:
        """The labels this node should carry now.

        Raises:
            XpuError: `xpu-smi` failed or printed something unreadable, or the snapshot is unusable
                (labels are left alone).
        """
        try:
            devices = self.source.list_devices()
        except XpuToolMissingError as exc:
            logger.info("%s: labelling the node as having no Kunlun card", exc)
            return build_labels((), Versions(None, None, None, None))
        return build_labels(devices, self.source.versions(devices))

    def apply(self) -> dict[str, str | None]:
        """One round; returns the patch sent (empty when the labels were already right).

        Raises:
            XpuError, ApiException, urllib3 HTTPError: the round failed.
        """
        desired = self.desired()
        assert set(desired) <= set(ALL_LABELS)
        node = self.api.read_node(self.node_name)
        labels = node.metadata.labels if node.metadata is not None else None
        current = dict(labels or {})
        patch = label_patch(current, desired)
        if patch:
            body = {"metadata": {"labels": patch}}
            self.api.patch_node(self.node_name, body, _content_type=MERGE_PATCH)
            self.patches += 1
            logger.info("node %s: labels patched %s", self.node_name, patch)
        return patch

    def run(
        self,
        stop: threading.Event,
        interval_seconds: float,
        max_backoff_seconds: float = 300.0,
        wait: Callable[[float], bool] | None = None,
    ) -> None:
        """Label until `stop` is set; `wait(seconds)` (default `stop.wait`) returns True to stop."""
        wait = wait or stop.wait
        backoff = 1.0
        while not stop.is_set():
            try:
                self.apply()
            except (XpuError, ApiException, HTTPError) as exc:
                logger.warning("node %s: labelling failed, retrying in %gs: %s", self.node_name, backoff, exc)
                if wait(backoff):
                    return
                backoff = min(backoff * 2, max_backoff_seconds)
                continue
            backoff = 1.0
            if wait(interval_seconds):
                return

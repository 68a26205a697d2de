"""The DRA plugin's Kubernetes API calls: read ResourceClaims, create and update its ResourceSlice.

Thin: plain dicts through `CustomObjectsApi` (the `resource.k8s.io/v1` paths), no decisions. The
`SlicePublisher` owns the pool generation: it starts one above what the API holds (a restarted
plugin never reuses a generation), bumps it whenever the slice's devices change, and writes the
whole spec with a JSON merge patch (lists are replaced whole). A failed write is logged and
retried at the next `publish`; the health loop that calls it never stops for the API.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes.client import CoreV1Api, CustomObjectsApi
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from kunlun_device.dra.slices import slice_name
from kunlun_device.errors import ClaimError

logger = logging.getLogger(__name__)
GROUP, VERSION = "resource.k8s.io", "v1"
MERGE_PATCH = "application/merge-patch+json"
API_TIMEOUT_SECONDS = 10


class KubeClaims:
    """`ClaimReader` over the API."""

    def __init__(self, api: CustomObjectsApi) -> None:
        self.api = api

    def read_claim(self, namespace: str, name: str) -> Mapping[str, Any]:
        try:
            claim = self.api.get_namespaced_custom_object(
                GROUP, VERSION, namespace, "resourceclaims", name, _request_timeout=API_TIMEOUT_SECONDS
            )
        except (ApiException, HTTPError) as exc:
            reason = f"HTTP {exc.status} {exc.reason}" if isinstance(exc, ApiException) else str(exc)
            raise ClaimError(f"claim {namespace}/{name}: cannot be read from the API: {reason}") from exc
        if not isinstance(claim, dict):
            raise ClaimError(
                f"claim {namespace}/{name}: the API answered {type(claim).__name__}, not an object"
            )
        return claim


class SlicePublisher:
    """Keeps the node's ResourceSlice equal to what `build(generation, node_uid)` returns."""

    def __init__(
        self,
        api: CustomObjectsApi,
        core: CoreV1Api,
        node_name: str,
        build: Callable[[int, str | None], dict[str, Any]],
    ) -> None:
        self.api = api
        self.core = core
        self.node_name = node_name
        self.build = build
        self.name = slice_name(node_name)
        self.generation: int | None = None  # None until the API was read
        self.node_uid: str | None = None
        self.writes = 0
        self._published: Any = None  # the devices last written
        self._existed = False  # whether the API holds the slice

    def publish(self) -> bool:
        """Write the slice if its devices changed (or it was never written); True when written."""
        try:
            if self.generation is None:
                self._read_start()
            assert self.generation is not None
            candidate = self.build(self.generation, self.node_uid)
            if self._published is not None and candidate["spec"]["devices"] == self._published:
                return False
            generation = self.generation + 1
            manifest = self.build(generation, self.node_uid)
            self._write(manifest, exists=self._published is not None or self._existed)
        except (ApiException, HTTPError) as exc:
            reason = f"HTTP {exc.status} {exc.reason}" if isinstance(exc, ApiException) else str(exc)
            logger.warning("ResourceSlice %s not written (retrying next round): %s", self.name, reason)
            return False
        self.generation = generation
        self._published = manifest["spec"]["devices"]
        self.writes += 1
        logger.info(
            "ResourceSlice %s generation %d: %d devices %s",
            self.name,
            generation,
            len(self._published),
            [d["name"] for d in self._published],
        )
        return True

    def _read_start(self) -> None:
        node = self.core.read_node(self.node_name, _request_timeout=API_TIMEOUT_SECONDS)
        self.node_uid = node.metadata.uid if node.metadata is not None else None
        try:
            current = self.api.get_cluster_custom_object(
                GROUP, VERSION, "resourceslices", self.name, _request_timeout=API_TIMEOUT_SECONDS
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            self._existed = False
            self.generation = 0
            return
        self._existed = True
        self.generation = int(current["spec"]["pool"]["generation"]) if isinstance(current, dict) else 0

    def _write(self, manifest: dict[str, Any], exists: bool) -> None:
        if exists:
            body = {"metadata": {"ownerReferences": manifest["metadata"].get("ownerReferences")}}
            body["spec"] = manifest["spec"]
            self.api.patch_cluster_custom_object(
                GROUP,
                VERSION,
                "resourceslices",
                self.name,
                body,
                _content_type=MERGE_PATCH,
                _request_timeout=API_TIMEOUT_SECONDS,
            )
        else:
            self.api.create_cluster_custom_object(
                GROUP, VERSION, "resourceslices", manifest, _request_timeout=API_TIMEOUT_SECONDS
            )
            self._existed = True

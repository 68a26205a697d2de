"""The DRA plugin's Kubernetes API calls: read ResourceClaims, create and update its ResourceSlice.

Thin: plain dicts through `CustomObjectsApi` (the `resource.k8s.io/v1` paths), no decisions. The
`SlicePublisher` reads the slice every round (kubelet deletes a node's slices when it starts and a
driver's ~30 s after the driver unregisters, so a slice written once may be gone) and writes it when
it is absent, malformed or holds other devices. It owns the pool generation: one above the highest
it has seen in the API or written (a restarted plugin never reuses a generation while the slice
exists), bumped on every write. The whole spec is written with a JSON merge patch (lists are
replaced whole, other top-level spec fields set to null). A failed call is logged and retried at
the next `publish`; the health loop that calls it never stops for the API.
"""

from __future__ import annotations

import logging
import threading
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


def _pool_state(current: Any) -> tuple[int, Any]:
    """The pool generation and the devices of a slice read from the API.

    Raises:
        ValueError: a field is missing or mistyped (named).
    """
    spec = current.get("spec") if isinstance(current, dict) else None
    pool = spec.get("pool") if isinstance(spec, dict) else None
    generation = pool.get("generation") if isinstance(pool, dict) else None
    if isinstance(generation, bool) or not isinstance(generation, int):
        raise ValueError(f"spec.pool.generation is {generation!r}, expected an integer")
    return generation, spec.get("devices") if isinstance(spec, dict) else None


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
        self.generation = 0  # the highest pool generation seen in the API or written
        self.node_uid: str | None = None
        self.writes = 0
        self._node_read = False
        self._lock = threading.Lock()  # the health thread and a registration both publish

    def publish(self) -> bool:
        """Read the slice; write it when absent, malformed or its devices differ. True when written."""
        with self._lock:
            try:
                return self._publish()
            except (ApiException, HTTPError) as exc:
                reason = f"HTTP {exc.status} {exc.reason}" if isinstance(exc, ApiException) else str(exc)
                logger.warning("ResourceSlice %s not written (retrying next round): %s", self.name, reason)
                return False

    def _publish(self) -> bool:
        if not self._node_read:
            node = self.core.read_node(self.node_name, _request_timeout=API_TIMEOUT_SECONDS)
            self.node_uid = node.metadata.uid if node.metadata is not None else None
            self._node_read = True
        current = self._read()
        if current is not None:
            try:
                generation, devices = _pool_state(current)
            except ValueError as exc:
                logger.error("ResourceSlice %s in the API is malformed (%s): replacing it", self.name, exc)
            else:
                self.generation = max(self.generation, generation)
                if devices == self.build(self.generation, self.node_uid)["spec"]["devices"]:
                    return False
        elif self.writes:
            logger.warning(
                "ResourceSlice %s is gone from the API (kubelet restarted?): creating it", self.name
            )
        manifest = self.build(self.generation + 1, self.node_uid)
        self._write(manifest, current)
        self.generation += 1
        self.writes += 1
        devices = manifest["spec"]["devices"]
        logger.info(
            "ResourceSlice %s generation %d: %d devices %s",
            self.name,
            self.generation,
            len(devices),
            [d["name"] for d in devices],
        )
        return True

    def _read(self) -> Any:
        """The slice as the API holds it; None when it does not exist."""
        try:
            return self.api.get_cluster_custom_object(
                GROUP, VERSION, "resourceslices", self.name, _request_timeout=API_TIMEOUT_SECONDS
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            return None

    def _write(self, manifest: dict[str, Any], current: Any) -> None:
        if current is None:
            self.api.create_cluster_custom_object(
                GROUP, VERSION, "resourceslices", manifest, _request_timeout=API_TIMEOUT_SECONDS
            )
            return
        old_spec = current.get("spec") if isinstance(current, dict) else None
        stale = {k: None for k in old_spec if k not in manifest["spec"]} if isinstance(old_spec, dict) else {}
        body = {
            "metadata": {"ownerReferences": manifest["metadata"].get("ownerReferences")},
            "spec": {**stale, **manifest["spec"]},
        }
        self.api.patch_cluster_custom_object(
            GROUP,
            VERSION,
            "resourceslices",
            self.name,
            body,
            _content_type=MERGE_PATCH,
            _request_timeout=API_TIMEOUT_SECONDS,
        )

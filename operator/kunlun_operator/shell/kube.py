"""The operator's Kubernetes API client: plain dicts in and out over the official ``kubernetes`` client.

Owns: URL paths of the kinds the operator touches, merge-patch calls, mapping HTTP failures to
``ApiError`` (404 on get/delete becomes None/False). The bottom of the shell: every call the
operator makes to the API goes through it. Every call is logged at debug level with verb and path.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

import kubernetes
import urllib3

from kunlun_operator import names
from kunlun_operator.errors import ApiError

logger = logging.getLogger(__name__)

POD = names.Kind("v1", "Pod", "pods")
PVC = names.Kind("v1", "PersistentVolumeClaim", "persistentvolumeclaims")
SECRET = names.Kind("v1", "Secret", "secrets")
REQUEST_TIMEOUT_SECONDS = 30
MERGE_PATCH = "application/merge-patch+json"


def load_config() -> kubernetes.client.ApiClient:
    """An API client from the in-cluster service account, else from ``KUBECONFIG``/~/.kube/config."""
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    return kubernetes.client.ApiClient()


class KubeClient:
    """Generic verbs on namespaced kinds; bodies are plain dicts."""

    def __init__(self, api_client: kubernetes.client.ApiClient) -> None:
        self._api = api_client

    @staticmethod
    def path(
        kind: names.Kind, namespace: str | None, name: str | None = None, subresource: str | None = None
    ) -> str:
        root = "/api/v1" if kind.api_version == "v1" else f"/apis/{kind.api_version}"
        parts = [root]
        if namespace is not None:
            parts.append(f"namespaces/{namespace}")
        parts.append(kind.plural)
        if name is not None:
            parts.append(name)
        if subresource is not None:
            parts.append(subresource)
        return "/".join(parts)

    def _call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any] | None:
        """The JSON object the API answered (None for an empty answer).

        Raises:
            ApiError: the call failed (HTTP status ≥ 400, or no answer at all).
        """
        logger.debug("%s %s", method, path)
        call = f"{method} {path}"
        try:
            method, url, headers, body, post = self._api.param_serialize(
                method=method,
                resource_path=path,
                query_params=list((query or {}).items()),
                header_params={"Accept": "application/json", "Content-Type": content_type},
                body=body,
                auth_settings=["BearerToken"],
            )
            response = self._api.call_api(
                method,
                url,
                header_params=headers,
                body=body,
                post_params=post,
                _request_timeout=REQUEST_TIMEOUT_SECONDS,
            )
            data = response.read()
        except kubernetes.client.ApiException as e:
            raise _api_error(e.status or 0, e.reason or "", e.body, call) from None
        except urllib3.exceptions.HTTPError as e:
            raise ApiError(0, "ConnectionError", str(e), call=call) from None
        if response.status >= 400:
            raise _api_error(response.status, response.reason or "", data, call)
        doc: dict[str, Any] | None = json.loads(data) if data else None  # the API answers objects
        return doc

    def get(self, kind: names.Kind, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            return self._call("GET", self.path(kind, namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def list(
        self,
        kind: names.Kind,
        namespace: str | None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> list[dict[str, Any]]:
        selectors = {"labelSelector": label_selector, "fieldSelector": field_selector}
        query = {k: v for k, v in selectors.items() if v} or None
        doc = self._call("GET", self.path(kind, namespace), query=query) or {}
        items: list[dict[str, Any]] = doc.get("items") or []
        return items

    def create(self, kind: names.Kind, namespace: str, body: Mapping[str, Any]) -> dict[str, Any] | None:
        return self._call("POST", self.path(kind, namespace), body=dict(body))

    def patch(
        self,
        kind: names.Kind,
        namespace: str,
        name: str,
        patch: Mapping[str, Any],
        *,
        subresource: str | None = None,
    ) -> dict[str, Any] | None:
        return self._call(
            "PATCH", self.path(kind, namespace, name, subresource), body=dict(patch), content_type=MERGE_PATCH
        )

    def delete(self, kind: names.Kind, namespace: str, name: str) -> bool:
        """Delete (background propagation); False when it was already gone."""
        try:
            self._call(
                "DELETE",
                self.path(kind, namespace, name),
                body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"},
            )
        except ApiError as e:
            if e.status == 404:
                return False
            raise
        return True

    def evict(self, namespace: str, name: str, *, uid: str | None = None) -> None:
        """Ask the API to evict a pod (``policy/v1`` Eviction), so PodDisruptionBudgets apply.

        Raises:
            ApiError: 429 when a PodDisruptionBudget allows no disruption now; 404 when the pod
                is gone; 409 when ``uid`` no longer names it.
        """
        body: dict[str, Any] = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": namespace},
        }
        if uid is not None:  # never evict a newer pod that reuses the name
            body["deleteOptions"] = {"preconditions": {"uid": uid}}
        self._call("POST", self.path(POD, namespace, name, "eviction"), body=body)

    def served_plurals(self, group_version: str) -> frozenset[str]:
        """Plurals the cluster serves in ``group_version`` (discovery); empty when it serves none."""
        try:
            doc = self._call("GET", f"/apis/{group_version}")
        except ApiError as e:
            if e.status in (404, 503):
                return frozenset()
            raise
        return frozenset(r["name"] for r in (doc or {}).get("resources", []) if "/" not in r["name"])


def _api_error(status: int, http_reason: str, body: bytes | str | None, call: str) -> ApiError:
    """An ``ApiError`` from a failed answer, with the reason and message of its Status body."""
    try:
        doc = json.loads(body or "{}")
    except ValueError:
        doc = {}
    doc = doc if isinstance(doc, dict) else {}
    return ApiError(status, doc.get("reason") or http_reason, doc.get("message") or http_reason, call=call)

"""A fake Kubernetes API over real HTTP on 127.0.0.1: kmock plus the fidelity operators need.

Use it where no real kube-apiserver can run (a machine without one or the means to fetch one; the
real-cluster e2e suite runs where ``KUBECONFIG`` points at a cluster)::

    from tests.support.kubeapi import running_fake_api

    def test_something(tmp_path):
        with running_fake_api(tmp_path) as kube:          # starts on a free port, in a thread
            client = kube.client()                         # an official `kubernetes` ApiClient
            kubernetes.client.CoreV1Api(client).create_node({"metadata": {"name": "n1"}})
            subprocess.run([...], env={**os.environ, "KUBECONFIG": str(kube.kubeconfig)})
            kube.fail("create", "services", status=500)    # the next create of a Service answers 500
            assert ("create", "", "services", "ml") in kube.calls()

or as a pytest fixture: ``from tests.support.kubeapi import fake_kube_api  # noqa: F401`` in a
test module, then take ``fake_kube_api`` (a ``RunningKubeAPI``). ``kube.url`` is the base URL,
``kube.kubeconfig`` a kubeconfig file pointing at it (token auth, plain HTTP) for kopf, kubectl-less
clients and subprocesses. ``running_fake_api(tmp_path, monitoring=True)`` also serves the
Prometheus Operator's ``monitoring.coreos.com/v1`` kinds, ``leaderworkerset=True`` LeaderWorkerSet's
``leaderworkerset.x-k8s.io/v1`` (stored objects only: no groups, no pods), ``routing=True`` the
Gateway API Inference Extension's ``inference.networking.k8s.io/v1`` InferencePool and Gateway API's
``gateway.networking.k8s.io/v1`` HTTPRoute (stored objects only: no gateway, no picker); kopf's
peering kinds (``kopf.dev/v1``) are always served.

kmock (``KubernetesScaffold``) gives the HTTP server, request parsing, the request log and API
discovery from the declared resources. This layer keeps the objects and adds what kmock 0.8 lacks:
``uid``, ``resourceVersion`` (one global counter), ``generation`` (bumped on spec changes only),
``creationTimestamp``, namespace from the URL, ``generateName``, 201 on create and 409 on an existing
name, 409 on a stale ``metadata.resourceVersion`` in a patch or PUT, merge patches (strategic-merge
is treated as a JSON merge patch: lists are replaced) and JSON patches (a failed ``test`` is 422),
status-subresource isolation, finalizers and ``deletionTimestamp``, equality-based label selectors,
equality-based field selectors on lists (``metadata.name``, ``metadata.namespace`` and the fields
the API server indexes for a kind, ``FIELD_LABELS``; any other field is a 400 as there; each list's
``fieldSelector`` is recorded, ``field_selectors()``), and watches that honour ``resourceVersion``
and ``timeoutSeconds``.

Evictions (``POST .../pods/NAME/eviction``, ``policy/v1``) are decided as the API server decides
them, minus the disruption controller (a test writes a budget's ``status`` itself; a budget without
``status.disruptionsAllowed`` allows every eviction, as nothing computes it). A
``deleteOptions.preconditions.uid`` that no longer names the pod is 409. Each PodDisruptionBudget of
the pod's namespace whose ``spec.selector.matchLabels`` select the pod then decides, by the pod's
health (healthy: its ``Ready`` condition is ``True``):

- a healthy pod needs ``status.disruptionsAllowed > 0``, and the eviction takes one from it;
- a pod that is not healthy, under ``spec.unhealthyPodEvictionPolicy: AlwaysAllow``, is evicted
  whatever the budget, taking nothing from it;
- a pod that is not healthy, under ``IfHealthyBudget`` (the default), is evicted taking nothing while
  ``status.currentHealthy >= status.desiredHealthy`` and ``desiredHealthy > 0`` (absent counts as 0),
  else it needs ``disruptionsAllowed > 0`` like a healthy pod.

A budget that refuses answers 429 (``TooManyRequests``, the pod stays). Otherwise the pod is deleted
(a pod with finalizers only gets its ``deletionTimestamp``: a test plays kubelet's graceful
termination by removing them) and the answer is 201.

Not emulated: controllers (Deployments get no status unless a test writes it, PodDisruptionBudgets
none unless a test writes it), garbage collection by owner reference, server-side apply, CRD schema
validation and defaulting, field selectors on watches, admission webhooks.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import json
import secrets
import threading
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp.web
import jsonpatch
import kmock
import kubernetes
import pytest

ALL_VERBS = ("get", "list", "watch", "create", "update", "patch", "delete", "deletecollection")


@dataclass(frozen=True)
class Kind:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True
    subresources: tuple[str, ...] = ()


BUILT_IN_KINDS = (
    Kind("", "v1", "namespaces", "Namespace", namespaced=False, subresources=("status",)),
    Kind("", "v1", "nodes", "Node", namespaced=False, subresources=("status",)),
    Kind("", "v1", "pods", "Pod", subresources=("status",)),
    Kind("", "v1", "services", "Service", subresources=("status",)),
    Kind("", "v1", "configmaps", "ConfigMap"),
    Kind("", "v1", "secrets", "Secret"),
    Kind("", "v1", "events", "Event"),
    Kind("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", subresources=("status",)),
    Kind("", "v1", "serviceaccounts", "ServiceAccount"),
    Kind("rbac.authorization.k8s.io", "v1", "roles", "Role"),
    Kind("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding"),
    Kind("apps", "v1", "deployments", "Deployment", subresources=("status", "scale")),
    Kind("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", subresources=("status",)),
    Kind(
        "autoscaling", "v2", "horizontalpodautoscalers", "HorizontalPodAutoscaler", subresources=("status",)
    ),
    Kind(
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        namespaced=False,
        subresources=("status",),
    ),
    Kind(
        "serving.kunlun.dev",
        "v1alpha1",
        "kunluninferenceservices",
        "KunlunInferenceService",
        subresources=("status", "scale"),
    ),
)
#: Dynamic Resource Allocation (``resource.k8s.io/v1``): stored objects only, no scheduler or allocator.
DRA_KINDS = (
    Kind("resource.k8s.io", "v1", "resourceslices", "ResourceSlice", namespaced=False),
    Kind("resource.k8s.io", "v1", "resourceclaims", "ResourceClaim", subresources=("status",)),
    Kind("resource.k8s.io", "v1", "resourceclaimtemplates", "ResourceClaimTemplate"),
    Kind("resource.k8s.io", "v1", "deviceclasses", "DeviceClass", namespaced=False),
)
PEERING_KINDS = (
    Kind("kopf.dev", "v1", "clusterkopfpeerings", "ClusterKopfPeering", namespaced=False),
    Kind("kopf.dev", "v1", "kopfpeerings", "KopfPeering"),
)
MONITORING_KINDS = (
    Kind("monitoring.coreos.com", "v1", "servicemonitors", "ServiceMonitor"),
    Kind("monitoring.coreos.com", "v1", "prometheusrules", "PrometheusRule"),
)


LEADERWORKERSET_KINDS = (
    Kind(
        "leaderworkerset.x-k8s.io",
        "v1",
        "leaderworkersets",
        "LeaderWorkerSet",
        subresources=("status", "scale"),
    ),
)

#: The Gateway API Inference Extension's InferencePool and Gateway API's HTTPRoute (routed services).
ROUTING_KINDS = (
    Kind("inference.networking.k8s.io", "v1", "inferencepools", "InferencePool", subresources=("status",)),
    Kind("gateway.networking.k8s.io", "v1", "httproutes", "HTTPRoute", subresources=("status",)),
)


@dataclass
class Fault:
    verb: str
    plural: str
    status: int
    times: int | None  # None: until cleared
    name: str | None = None
    subresource: str | None = None
    fired: int = 0


@dataclass(frozen=True)
class Target:
    """A parsed resource URL."""

    kind: Kind
    namespace: str | None
    name: str | None
    subresource: str | None


class ApiStatusError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (None deletes; lists and scalars replace)."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge_patch(result.get(key), value)
    return result


def _matches_selector(labels: Mapping[str, str], selector: str | None) -> bool:
    """Equality-based selectors: ``a=b``, ``a==b``, ``a!=b``, ``a``, ``!a``."""
    for term in filter(None, (t.strip() for t in (selector or "").split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


#: Fields a kind can be listed by besides ``metadata.name`` and ``metadata.namespace`` (the API
#: server's field label conversions; kinds the tests list by field only).
FIELD_LABELS: dict[str, tuple[str, ...]] = {
    "resource.k8s.io/resourceslices": ("spec.driver", "spec.nodeName", "spec.pool.name"),
}


def _field_labels(key: str, selector: str | None) -> tuple[str, ...]:
    """The fields kind ``key`` can be listed by.

    Raises:
        ApiStatusError: 400, ``selector`` names a field the API server does not index for the kind.
    """
    labels = ("metadata.name", "metadata.namespace", *FIELD_LABELS.get(key, ()))
    for term in filter(None, (t.strip() for t in (selector or "").split(","))):
        field = term.replace("!=", "=").split("=", 1)[0].strip()
        if field not in labels:
            raise ApiStatusError(400, "BadRequest", f'field label not supported: "{field}"')
    return labels


def _field_values(labels: tuple[str, ...], obj: Mapping[str, Any]) -> dict[str, str]:
    """The fields ``labels`` of ``obj`` as a flat mapping for ``_matches_selector``."""
    values = {}
    for label in labels:
        value: Any = obj
        for part in label.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        values[label] = "" if value is None else str(value)
    return values


def _selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A label selector's ``matchLabels`` (``matchExpressions`` are not emulated); an empty one selects all."""
    match_labels = (selector or {}).get("matchLabels") or {}
    return all(labels.get(k) == v for k, v in match_labels.items())


def _pod_ready(pod: Mapping[str, Any]) -> bool:
    """The disruption controller's "healthy": the pod's ``Ready`` condition is ``True``."""
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _eviction_charges(pdb: Mapping[str, Any], pod: Mapping[str, Any]) -> bool:
    """Whether evicting ``pod`` needs (and takes) one of ``pdb``'s ``disruptionsAllowed``.

    The API server's rule: a pod that is not Ready does not count as healthy, so
    ``AlwaysAllow`` lets it go at once, and ``IfHealthyBudget`` (the default) lets it go while the
    budget's healthy pods are enough without it; every other eviction is charged.
    """
    if _pod_ready(pod):
        return True
    if (pdb.get("spec") or {}).get("unhealthyPodEvictionPolicy") == "AlwaysAllow":
        return False
    status = pdb.get("status") or {}
    desired = int(status.get("desiredHealthy") or 0)
    return not (int(status.get("currentHealthy") or 0) >= desired and desired > 0)


@dataclass
class Store:
    """The objects, the change history (for watches) and the global resourceVersion."""

    objects: dict[tuple[str, str | None, str], dict[str, Any]] = field(default_factory=dict)
    history: list[tuple[int, str, dict[str, Any]]] = field(default_factory=list)  # (rv, plural key, event)
    resource_version: int = 1

    def bump(self) -> str:
        self.resource_version += 1
        return str(self.resource_version)

    def record(self, key: str, type_: str, obj: dict[str, Any]) -> None:
        self.history.append((self.resource_version, key, {"type": type_, "object": copy.deepcopy(obj)}))


@contextlib.contextmanager
def _as_status_errors() -> Iterator[None]:
    try:
        yield
    except jsonpatch.JsonPatchTestFailed as e:
        raise ApiStatusError(422, "Invalid", f"the JSON patch test failed: {e}") from None
    except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
        raise ApiStatusError(422, "Invalid", f"the JSON patch cannot be applied: {e}") from None


class FakeKubeAPI(kmock.KubernetesScaffold):
    """The handler: kmock's scaffold for discovery, this class for objects, watches and faults."""

    def __init__(
        self, *, monitoring: bool = False, leaderworkerset: bool = False, routing: bool = False
    ) -> None:
        super().__init__()
        self.kinds = {
            (k.group, k.version, k.plural): k
            for k in (
                *BUILT_IN_KINDS,
                *DRA_KINDS,
                *PEERING_KINDS,
                *(MONITORING_KINDS if monitoring else ()),
                *(LEADERWORKERSET_KINDS if leaderworkerset else ()),
                *(ROUTING_KINDS if routing else ()),
            )
        }
        for k in self.kinds.values():
            self.resources[f"{k.group}/{k.version}/{k.plural}" if k.group else f"v1/{k.plural}"] = (
                kmock.ResourceInfo(
                    kind=k.kind,
                    namespaced=k.namespaced,
                    verbs=set(ALL_VERBS),
                    subresources=set(k.subresources),
                )
            )
        self.store = Store()
        self.lock = threading.Lock()  # guards the store, faults and calls across threads
        self.faults: list[Fault] = []
        self.call_log: list[tuple[str, str, str, str | None]] = []  # (verb, group, resource, namespace)
        self.field_selector_log: list[tuple[str, str, str | None]] = []  # lists: (group, resource, selector)
        self.changed: asyncio.Condition | None = None

    # --- routing -----------------------------------------------------------------------------------

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        if raw_request.path.rstrip("/") != "/api/v1/namespaces":
            return await super().__call__(raw_request)
        # kmock 0.8's path parser fails on the namespaces collection: parse this one ourselves.
        body = await raw_request.read()
        request = kmock.Request(
            method=raw_request.method,
            url=raw_request.url,
            params=dict(raw_request.query),
            headers=dict(raw_request.headers),
            body=body,
            data=json.loads(body) if body else None,
            raw_request=raw_request,
        )
        return await self._handle(request)

    def parse(self, path: str) -> Target | None:
        parts = [p for p in path.split("/") if p]
        if len(parts) >= 2 and parts[0] == "api":
            group, version, rest = "", parts[1], parts[2:]
        elif len(parts) >= 3 and parts[0] == "apis":
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            return None
        namespace = None
        if len(rest) >= 3 and rest[0] == "namespaces" and rest[2] not in ("status", "finalize"):
            namespace, rest = rest[1], rest[2:]
        if not rest or (group, version, rest[0]) not in self.kinds:
            return None
        kind = self.kinds[(group, version, rest[0])]
        return Target(kind, namespace, rest[1] if len(rest) > 1 else None, "/".join(rest[2:]) or None)

    @staticmethod
    def verb(method: str, target: Target, params: Mapping[str, str]) -> str:
        if method == "GET":
            return "watch" if params.get("watch") in ("true", "1") else "get" if target.name else "list"
        if method == "DELETE":
            return "delete" if target.name else "deletecollection"
        return {"POST": "create", "PATCH": "patch", "PUT": "update"}.get(method, method.lower())

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        target = self.parse(request.url.path)
        if request.url.path in ("/api/", "/apis/"):  # clients add a slash that kmock does not route
            serve = self._serve_api if request.url.path == "/api/" else self._serve_apis
            return aiohttp.web.json_response(await serve(request))
        if target is None:
            return await super()._handle(request)  # discovery, version, user reactions, 404s
        if self.changed is None:
            self.changed = asyncio.Condition()
        verb = self.verb(str(request.method.value).upper(), target, request.params)
        resource = f"{target.kind.plural}/{target.subresource}" if target.subresource else target.kind.plural
        with self.lock:
            self.call_log.append((verb, target.kind.group, resource, target.namespace))
            fault = self._take_fault(verb, target)
        try:
            if fault is not None:
                raise ApiStatusError(
                    fault.status, "InjectedFault", f"injected {fault.status} for {verb} {resource}"
                )
            if verb == "watch":
                return await self._watch(request, target)
            status, body = self._serve(verb, target, request)
            if verb in ("create", "update", "patch", "delete"):
                async with self.changed:
                    self.changed.notify_all()
            return aiohttp.web.json_response(body, status=status)
        except ApiStatusError as e:
            return aiohttp.web.json_response(
                {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "metadata": {},
                    "status": "Failure",
                    "message": e.message,
                    "reason": e.reason,
                    "code": e.code,
                },
                status=e.code,
            )

    def _take_fault(self, verb: str, target: Target) -> Fault | None:
        for fault in self.faults:
            if (
                (fault.verb, fault.plural) == (verb, target.kind.plural)
                and fault.times != 0
                and fault.name in (None, target.name)
                and fault.subresource == target.subresource
            ):
                fault.fired += 1
                if fault.times is not None:
                    fault.times -= 1
                return fault
        return None

    # --- objects -----------------------------------------------------------------------------------

    def _serve(self, verb: str, target: Target, request: kmock.Request) -> tuple[int, Any]:
        key = f"{target.kind.group}/{target.kind.plural}"
        with self.lock:
            if verb == "list":
                fields = request.params.get("fieldSelector")
                self.field_selector_log.append((target.kind.group, target.kind.plural, fields))
                field_labels = _field_labels(key, fields)
                items = [
                    copy.deepcopy(o)
                    for (k, ns, _), o in sorted(self.store.objects.items())
                    if k == key
                    and (target.namespace is None or ns == target.namespace)
                    and _matches_selector(
                        o["metadata"].get("labels") or {}, request.params.get("labelSelector")
                    )
                    and _matches_selector(_field_values(field_labels, o), fields)
                ]
                return 200, {
                    "apiVersion": "v1",
                    "kind": f"{target.kind.kind}List",
                    "items": items,
                    "metadata": {"resourceVersion": str(self.store.resource_version)},
                }
            if verb == "create" and (target.kind.plural, target.subresource) == ("pods", "eviction"):
                return 201, self._evict(target, request.data)
            if verb == "create":
                return 201, self._create(key, target, request.data)
            obj = self.store.objects.get((key, target.namespace, target.name or ""))
            if obj is None:
                raise ApiStatusError(404, "NotFound", f'{target.kind.plural} "{target.name}" not found')
            if verb == "get":
                return 200, copy.deepcopy(obj)
            if verb == "delete":
                return 200, self._delete(key, target, obj)
            if verb in ("patch", "update"):
                return 200, self._change(key, target, obj, request)
        raise ApiStatusError(405, "MethodNotAllowed", f"{verb} is not emulated")

    def _create(self, key: str, target: Target, body: Any) -> dict[str, Any]:
        if not isinstance(body, Mapping):
            raise ApiStatusError(400, "BadRequest", "the body must be a JSON object")
        obj = copy.deepcopy(dict(body))
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        if not meta.get("name"):
            raise ApiStatusError(422, "Invalid", "metadata.name: Required value")
        if target.namespace is not None:
            meta["namespace"] = target.namespace
        if (key, target.namespace, meta["name"]) in self.store.objects:
            raise ApiStatusError(
                409, "AlreadyExists", f'{target.kind.plural} "{meta["name"]}" already exists'
            )
        if "status" in target.kind.subresources:
            obj.pop("status", None)
        meta.update(
            uid=str(uuid.uuid4()), resourceVersion=self.store.bump(), generation=1, creationTimestamp=_now()
        )
        obj.setdefault("apiVersion", f"{target.kind.group}/{target.kind.version}".lstrip("/"))
        obj.setdefault("kind", target.kind.kind)
        self.store.objects[(key, target.namespace, meta["name"])] = obj
        self.store.record(key, "ADDED", obj)
        return copy.deepcopy(obj)

    def _change(
        self, key: str, target: Target, obj: dict[str, Any], request: kmock.Request
    ) -> dict[str, Any]:
        content_type = request.headers.get("Content-Type", "").split(";")[0]
        body = request.data
        if isinstance(body, Mapping):
            wanted_rv = (body.get("metadata") or {}).get("resourceVersion")
            if wanted_rv is not None and str(wanted_rv) != obj["metadata"]["resourceVersion"]:
                raise ApiStatusError(
                    409,
                    "Conflict",
                    "the object has been modified; please apply your "
                    "changes to the latest version and try again",
                )
        if content_type == "application/apply-patch+yaml":
            raise ApiStatusError(415, "UnsupportedMediaType", "server-side apply is not emulated")
        if request.method.value.upper() == "PUT":
            new = copy.deepcopy(dict(body))
        elif content_type == "application/json-patch+json":
            with _as_status_errors():
                new = jsonpatch.apply_patch(copy.deepcopy(obj), body)
        else:
            new = _merge_patch(obj, body)
        has_status = "status" in target.kind.subresources
        if target.subresource == "status":
            new = {**copy.deepcopy(obj), "status": new.get("status")}
        elif has_status:  # the main resource never changes the status of such kinds
            new["status"] = copy.deepcopy(obj.get("status"))
        if new.get("status") is None:
            new.pop("status", None)
        meta = new.setdefault("metadata", {})
        for fixed in (
            "name",
            "namespace",
            "uid",
            "creationTimestamp",
            "generation",
            "resourceVersion",
            "deletionTimestamp",
        ):
            if fixed in obj["metadata"]:
                meta[fixed] = obj["metadata"][fixed]
        if new == obj:
            return copy.deepcopy(obj)  # a no-op write changes nothing, not even the resourceVersion
        spec_of = lambda o: {k: v for k, v in o.items() if k not in ("metadata", "status")}  # noqa: E731
        if spec_of(new) != spec_of(obj):
            meta["generation"] = obj["metadata"].get("generation", 1) + 1
        meta["resourceVersion"] = self.store.bump()
        store_key = (key, target.namespace, target.name or "")
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            del self.store.objects[store_key]
            self.store.record(key, "DELETED", new)
        else:
            self.store.objects[store_key] = new
            self.store.record(key, "MODIFIED", new)
        return copy.deepcopy(new)

    def _delete(self, key: str, target: Target, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        if meta.get("finalizers"):
            if not meta.get("deletionTimestamp"):
                meta["deletionTimestamp"] = _now()
                meta["resourceVersion"] = self.store.bump()
                self.store.record(key, "MODIFIED", obj)
            return copy.deepcopy(obj)
        del self.store.objects[(key, target.namespace, target.name or "")]
        meta["resourceVersion"] = self.store.bump()
        self.store.record(key, "DELETED", obj)
        return copy.deepcopy(obj)

    def _evict(self, target: Target, body: Any) -> dict[str, Any]:
        """The Eviction subresource: the budgets selecting the pod decide (see the module docstring)."""
        pod = self.store.objects.get(("/pods", target.namespace, target.name or ""))
        if pod is None:
            raise ApiStatusError(404, "NotFound", f'pods "{target.name}" not found')
        options = (body.get("deleteOptions") if isinstance(body, Mapping) else None) or {}
        wanted_uid = (options.get("preconditions") or {}).get("uid")
        if wanted_uid is not None and wanted_uid != pod["metadata"]["uid"]:
            raise ApiStatusError(
                409,
                "Conflict",
                f"Precondition failed: UID in precondition: {wanted_uid}, "
                f"UID in object meta: {pod['metadata']['uid']}",
            )
        labels = pod["metadata"].get("labels") or {}
        budgets = [
            pdb
            for (k, ns, _), pdb in sorted(self.store.objects.items())
            if k == "policy/poddisruptionbudgets"
            and ns == target.namespace
            and "disruptionsAllowed" in (pdb.get("status") or {})
            and _selects((pdb.get("spec") or {}).get("selector"), labels)
        ]
        charged = [pdb for pdb in budgets if _eviction_charges(pdb, pod)]
        if any(pdb["status"]["disruptionsAllowed"] <= 0 for pdb in charged):
            raise ApiStatusError(
                429, "TooManyRequests", "Cannot evict pod as it would violate the pod's disruption budget."
            )
        for pdb in charged:
            pdb["status"]["disruptionsAllowed"] -= 1
            pdb["metadata"]["resourceVersion"] = self.store.bump()
            self.store.record("policy/poddisruptionbudgets", "MODIFIED", pdb)
        self._delete("/pods", target, pod)
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}

    # --- watches -----------------------------------------------------------------------------------

    async def _watch(self, request: kmock.Request, target: Target) -> aiohttp.web.StreamResponse:
        key = f"{target.kind.group}/{target.kind.plural}"
        params = request.params
        timeout = float(params.get("timeoutSeconds") or 1800)
        selector = params.get("labelSelector")
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request._raw_request)

        def wanted(event: Mapping[str, Any]) -> bool:
            meta = event["object"]["metadata"]
            return (
                (target.namespace is None or meta.get("namespace") == target.namespace)
                and (target.name is None or meta.get("name") == target.name)
                and _matches_selector(meta.get("labels") or {}, selector)
            )

        with self.lock:
            since = params.get("resourceVersion")
            if since in (None, "", "0"):  # start from now, with synthetic ADDED events
                backlog = [
                    {"type": "ADDED", "object": copy.deepcopy(o)}
                    for (k, _, _), o in sorted(self.store.objects.items())
                    if k == key
                ]
                since_rv = self.store.resource_version
            else:
                since_rv, backlog = int(since), []
            position = len(self.store.history)
            backlog += [e for rv, k, e in self.store.history if k == key and rv > since_rv]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            for event in backlog:
                if wanted(event):
                    await response.write(json.dumps(event).encode() + b"\n")
            while (remaining := deadline - loop.time()) > 0:
                async with self.changed:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.changed.wait(), remaining)
                with self.lock:
                    fresh, position = self.store.history[position:], len(self.store.history)
                for _, k, event in fresh:
                    if k == key and wanted(event):
                        await response.write(json.dumps(event).encode() + b"\n")
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        return response


@dataclass
class RunningKubeAPI:
    """Handle of a running fake API (see the module docstring)."""

    api: FakeKubeAPI
    url: str
    kubeconfig: Path
    loop: asyncio.AbstractEventLoop

    def client(self) -> kubernetes.client.ApiClient:
        return kubernetes.config.new_client_from_config(config_file=str(self.kubeconfig))

    def fail(
        self,
        verb: str,
        plural: str,
        *,
        status: int = 500,
        times: int | None = 1,
        name: str | None = None,
        subresource: str | None = None,
    ) -> Fault:
        """Answer the next ``times`` (None: all) ``verb`` calls on ``plural`` with ``status``."""
        fault = Fault(verb, plural, status, times, name, subresource)
        with self.api.lock:
            self.api.faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        with self.api.lock:
            self.api.faults.clear()

    def calls(self) -> list[tuple[str, str, str, str | None]]:
        """Every resource call so far: (verb, API group, resource[/subresource], namespace)."""
        with self.api.lock:
            return list(self.api.call_log)

    def field_selectors(self, plural: str, group: str = "") -> list[str | None]:
        """The ``fieldSelector`` of each list of one kind so far (None: the list had none)."""
        with self.api.lock:
            return [f for g, p, f in self.api.field_selector_log if (g, p) == (group, plural)]

    def objects(self, plural: str, group: str = "") -> list[dict[str, Any]]:
        """A snapshot of the stored objects of one kind."""
        with self.api.lock:
            return [
                copy.deepcopy(o)
                for (k, _, _), o in sorted(self.api.store.objects.items())
                if k == f"{group}/{plural}"
            ]


def write_kubeconfig(path: Path, url: str) -> Path:
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "fake",
                "clusters": [{"name": "fake", "cluster": {"server": url}}],
                "users": [{"name": "fake", "user": {"token": "fake-token"}}],
                "contexts": [
                    {"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": "default"}}
                ],
            }
        )
    )
    return path


@contextlib.contextmanager
def running_fake_api(
    tmp_path: Path, *, monitoring: bool = False, leaderworkerset: bool = False, routing: bool = False
) -> Iterator[RunningKubeAPI]:
    """Serve a ``FakeKubeAPI`` on 127.0.0.1 (a free port) from a background thread until exit."""
    started = threading.Event()
    handle: dict[str, Any] = {}

    async def serve() -> None:
        api = FakeKubeAPI(monitoring=monitoring, leaderworkerset=leaderworkerset, routing=routing)
        stop = asyncio.Event()
        async with api, kmock.Server(api) as server:
            handle.update(
                api=api, url=str(server.url).rstrip("/"), stop=stop, loop=asyncio.get_running_loop()
            )
            started.set()
            await stop.wait()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), name="fake-kube-api", daemon=True)
    thread.start()
    if not started.wait(10):
        raise RuntimeError("the fake Kubernetes API did not start")
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig.json", handle["url"])
    try:
        yield RunningKubeAPI(handle["api"], handle["url"], kubeconfig, handle["loop"])
    finally:
        handle["loop"].call_soon_threadsafe(handle["stop"].set)
        thread.join(10)


@pytest.fixture
def fake_kube_api(tmp_path: Path) -> Iterator[RunningKubeAPI]:
    """A running fake Kubernetes API (without the Prometheus Operator kinds)."""
    with running_fake_api(tmp_path) as kube:
        yield kube

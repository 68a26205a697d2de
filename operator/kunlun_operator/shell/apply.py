"""Apply a desired object idempotently: create it, patch what differs, or leave it alone.

Owns: the drift test (is everything the operator wants present in the live object, quantities
compared by value?), the merge patch that also removes fields the operator set before but no
longer wants (remembered in the ``serving.kunlun.dev/last-applied`` annotation, as kubectl does),
and the ownership guard. Invariant: applying the same desired object twice makes no second write.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Final, Literal

from kubernetes.utils import parse_quantity

from kunlun_operator import names
from kunlun_operator.errors import ApiError, OwnershipError
from kunlun_operator.shell.kube import KubeClient

Action = Literal["created", "updated", "restored", "deleted", "unchanged"]
CREATED: Final = "created"
UPDATED: Final = "updated"
RESTORED: Final = "restored"
DELETED: Final = "deleted"
UNCHANGED: Final = "unchanged"
_QUANTITY_KEYS = frozenset({"requests", "limits"})


@dataclass(frozen=True, slots=True)
class Change:
    kind: str
    name: str
    action: Action


def is_subset(desired: object, actual: object, *, quantities: bool = False) -> bool:
    """Whether ``actual`` holds everything in ``desired`` (extra keys, e.g. server defaults, allowed).

    Lists must have the same length and match element by element; under ``resources.requests`` and
    ``limits`` quantities compare by value ("1000m" == "1").
    """
    if isinstance(desired, Mapping):
        return isinstance(actual, Mapping) and all(
            key in actual and is_subset(value, actual[key], quantities=quantities or key in _QUANTITY_KEYS)
            for key, value in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(actual, list)
            and len(desired) == len(actual)
            and all(is_subset(d, a) for d, a in zip(desired, actual, strict=True))
        )
    if quantities and isinstance(desired, str) and isinstance(actual, str) and desired != actual:
        try:
            wanted: Decimal = parse_quantity(desired)
            live: Decimal = parse_quantity(actual)
        except ValueError:
            return False
        return wanted == live
    return desired == actual


def removal_patch(desired: Mapping[str, Any], previous: Mapping[str, Any]) -> dict[str, Any]:
    """``desired`` plus ``None`` for every key ``previous`` had and ``desired`` dropped (JSON merge patch)."""
    patch: dict[str, Any] = {}
    for key, value in desired.items():
        before = previous.get(key)
        patch[key] = (
            removal_patch(value, before)
            if isinstance(value, Mapping) and isinstance(before, Mapping)
            else value
        )
    for key in previous:
        if key not in desired:
            patch[key] = None
    return patch


def with_last_applied(desired: Mapping[str, Any]) -> dict[str, Any]:
    """``desired`` carrying the annotation that remembers it, for the next removal patch."""
    meta = dict(desired["metadata"])
    meta["annotations"] = {
        **(meta.get("annotations") or {}),
        names.ANNOTATION_LAST_APPLIED: json.dumps(desired, sort_keys=True, separators=(",", ":")),
    }
    return {**desired, "metadata": meta}


def last_applied(actual: Mapping[str, Any]) -> dict[str, Any] | None:
    text = ((actual.get("metadata") or {}).get("annotations") or {}).get(names.ANNOTATION_LAST_APPLIED)
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None


def is_owned(actual: Mapping[str, Any], owner_name: str, owner_uid: str) -> bool:
    """Ours: controlled by this service, or labelled as managed by the operator for this instance."""
    meta = actual.get("metadata") or {}
    if any(ref.get("uid") == owner_uid for ref in meta.get("ownerReferences") or []):
        return True
    labels = meta.get("labels") or {}
    return (
        labels.get(names.LABEL_MANAGED_BY) == names.MANAGER and labels.get(names.LABEL_INSTANCE) == owner_name
    )


def apply_object(
    client: KubeClient,
    desired: Mapping[str, Any],
    *,
    owner_uid: str,
    existed_before: bool,
    live_fields: tuple[tuple[str, ...], ...] = (),
) -> Change:
    """Create or patch ``desired``. ``existed_before``: the operator had made it already (so a missing
    or different object is drift to restore, not a first creation or a spec change).
    ``live_fields``: paths another controller owns; their live values are kept.

    Raises:
        ApiError: a call failed (retryable ones are retried by the caller).
        OwnershipError: an object of that name exists and belongs to someone else.
    """
    kind = _kind_of(desired)
    meta = desired["metadata"]
    namespace, name, instance = meta["namespace"], meta["name"], meta["labels"][names.LABEL_INSTANCE]
    actual = client.get(kind, namespace, name)
    if actual is None:
        try:
            client.create(kind, namespace, with_last_applied(desired))
            return Change(kind.kind, name, RESTORED if existed_before else CREATED)
        except ApiError as e:
            if e.status != 409:
                raise
            actual = client.get(kind, namespace, name)  # created meanwhile (a restarted operator's twin)
            if actual is None:
                raise
    desired = keep_live_fields(desired, actual, live_fields)
    if not is_owned(actual, instance, owner_uid):
        raise OwnershipError(f"{kind.kind} {namespace}/{name} exists and is not managed by this service")
    target = with_last_applied(desired)
    if is_subset(target, actual):
        return Change(kind.kind, name, UNCHANGED)
    previous = last_applied(actual) or {}
    client.patch(kind, namespace, name, removal_patch(target, previous))
    drifted = previous == json.loads(json.dumps(desired))
    return Change(kind.kind, name, RESTORED if drifted else UPDATED)


def keep_live_fields(
    desired: Mapping[str, Any], actual: Mapping[str, Any], paths: tuple[tuple[str, ...], ...]
) -> Mapping[str, Any]:
    """``desired`` with the live value at each of ``paths`` (e.g. the HPA's ``spec.replicas``)."""
    if not paths:
        return desired
    result = copy.deepcopy(dict(desired))
    for path in paths:
        live: Any = actual
        for key in path:
            live = live.get(key) if isinstance(live, Mapping) else None
        if live is not None:
            target: dict[str, Any] = result
            for key in path[:-1]:
                target = target.setdefault(key, {})
            target[path[-1]] = live
    return result


def delete_object(
    client: KubeClient, kind: names.Kind, namespace: str, name: str, *, owner_name: str, owner_uid: str
) -> Change | None:
    """Delete the owned object ``name`` of ``kind`` if it exists and is ours."""
    actual = client.get(kind, namespace, name)
    if actual is None or not is_owned(actual, owner_name, owner_uid):
        return None
    return Change(kind.kind, name, DELETED) if client.delete(kind, namespace, name) else None


#: Where each owned kind lives in the API (kinds that differ only by their name suffix, like the
#: Endpoint Picker's Deployment, live in the same place as the first of their kind).
_KINDS: dict[tuple[str, str], names.Kind] = {}
for _kind in names.OWNED_KINDS:
    _KINDS.setdefault((_kind.api_version, _kind.kind), _kind)


def _kind_of(obj: Mapping[str, Any]) -> names.Kind:
    return _KINDS[(obj["apiVersion"], obj["kind"])]

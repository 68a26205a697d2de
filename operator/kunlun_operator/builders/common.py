"""What every owned object shares: name, namespace, common labels, the owner reference; the
restricted security context of every container.

Invariant: the owner reference is the controller reference of the KunlunInferenceService, so the
garbage collector removes what the operator owns when the service is deleted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kunlun_operator import names
from kunlun_operator.spec.service import ServiceRef

#: Every container the operator builds runs under the Pod Security "restricted" profile.
RESTRICTED_CONTAINER = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "readOnlyRootFilesystem": True,
}


#: What tells the Endpoint Picker's objects and pods from the runtime's (over the common labels):
#: its pods must never match the runtime's selectors (Service, PDB, InferencePool, pod watch).
PICKER_LABELS = {names.LABEL_NAME: names.PICKER_APP_NAME, names.LABEL_COMPONENT: "endpoint-picker"}


def owner_reference(ref: ServiceRef) -> dict[str, Any]:
    return {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "name": ref.name,
        "uid": ref.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def build_metadata(
    ref: ServiceRef,
    kind: names.Kind,
    *,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """``metadata`` of the object of ``kind`` owned by ``ref``."""
    meta: dict[str, Any] = {
        "name": names.owned_name(ref.name, kind),
        "namespace": ref.namespace,
        "labels": {**names.common_labels(ref.name), **(labels or {})},
    }
    if annotations:
        meta["annotations"] = dict(annotations)
    meta["ownerReferences"] = [owner_reference(ref)]
    return meta


def header(kind: names.Kind) -> dict[str, str]:
    return {"apiVersion": kind.api_version, "kind": kind.kind}

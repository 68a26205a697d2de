"""The Endpoint Picker's identity and rights: a ServiceAccount, a Role and the RoleBinding between.

Owns: what the picker may read in its service's namespace, exactly what the Gateway API Inference
Extension's chart grants it: pods (the pool's endpoints), InferencePools (its own pool) and the
extension's InferenceObjectives and InferenceModelRewrites (request priorities and model rewrites),
get, list and watch only. Namespaced: nothing cluster-wide. Invariant: the operator holds each of
these rights itself (``api_calls.yaml``, rules marked ``grant``), as Kubernetes allows a Role to be
created only by someone who has what it grants.
"""

from __future__ import annotations

from typing import Any

from kunlun_operator import names
from kunlun_operator.builders.common import PICKER_LABELS, build_metadata, header
from kunlun_operator.spec.service import ServiceRef

READ = ["get", "list", "watch"]
#: The picker Role's rules (also the operator's ``grant`` rules in ``api_calls.yaml``).
PICKER_RULES: tuple[dict[str, Any], ...] = (
    {"apiGroups": [""], "resources": ["pods"], "verbs": READ},
    {
        "apiGroups": [names.INFERENCE_GROUP_VERSION.partition("/")[0]],
        "resources": ["inferencepools"],
        "verbs": READ,
    },
    {
        "apiGroups": [names.INFERENCE_X_GROUP],
        "resources": ["inferenceobjectives", "inferencemodelrewrites"],
        "verbs": READ,
    },
)


def build_picker_serviceaccount(ref: ServiceRef) -> dict[str, Any]:
    return {
        **header(names.PICKER_SERVICE_ACCOUNT),
        "metadata": build_metadata(ref, names.PICKER_SERVICE_ACCOUNT, labels=PICKER_LABELS),
        "automountServiceAccountToken": False,  # the picker's pod mounts it explicitly
    }


def build_picker_role(ref: ServiceRef) -> dict[str, Any]:
    return {
        **header(names.PICKER_ROLE),
        "metadata": build_metadata(ref, names.PICKER_ROLE, labels=PICKER_LABELS),
        "rules": [
            {"apiGroups": list(r["apiGroups"]), "resources": list(r["resources"]), "verbs": list(r["verbs"])}
            for r in PICKER_RULES
        ],
    }


def build_picker_rolebinding(ref: ServiceRef) -> dict[str, Any]:
    return {
        **header(names.PICKER_ROLE_BINDING),
        "metadata": build_metadata(ref, names.PICKER_ROLE_BINDING, labels=PICKER_LABELS),
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": names.owned_name(ref.name, names.PICKER_ROLE),
        },
        "subjects": [
            {
                "kind": "ServiceAccount",
                "name": names.owned_name(ref.name, names.PICKER_SERVICE_ACCOUNT),
                "namespace": ref.namespace,
            }
        ],
    }

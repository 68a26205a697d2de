"""The HTTPRoute that attaches a routed service's InferencePool to the Gateway the user names.

Owns: the Gateway API ``gateway.networking.k8s.io/v1`` HTTPRoute of ``spec.routing.gateway``: its
parent is that Gateway (and listener, with ``sectionName``), every path goes to the InferencePool
(a ``backendRef`` of group ``inference.networking.k8s.io``), and no request timeout cuts a long
generation short. Only with a gateway named: without one the pool is a backend for routes the user
writes (e.g. matching a model-name header set by a body-based router).
"""

from __future__ import annotations

from typing import Any

from kunlun_operator import names
from kunlun_operator.builders.common import build_metadata, header
from kunlun_operator.spec.service import ServiceRef
from kunlun_operator.spec.values import GatewayRef, InferenceSpec

GATEWAY_GROUP = names.GATEWAY_GROUP_VERSION.partition("/")[0]
INFERENCE_GROUP = names.INFERENCE_GROUP_VERSION.partition("/")[0]
#: "0s" disables the route's request timeout: a streamed generation may run for minutes.
REQUEST_TIMEOUT = "0s"


def parent_ref(gateway: GatewayRef) -> dict[str, Any]:
    """The route's parent: the named Gateway (in its namespace, on its listener when given)."""
    ref: dict[str, Any] = {"group": GATEWAY_GROUP, "kind": "Gateway", "name": gateway.name}
    if gateway.namespace is not None:
        ref["namespace"] = gateway.namespace
    if gateway.section_name is not None:
        ref["sectionName"] = gateway.section_name
    return ref


def build_httproute(ref: ServiceRef, spec: InferenceSpec) -> dict[str, Any]:
    """The route of ``spec.routing.gateway``.

    Raises:
        ValueError: the spec names no gateway (the caller builds a route only for one that does).
    """
    gateway = spec.routing.gateway
    if gateway is None:
        raise ValueError("spec.routing.gateway is not set: no HTTPRoute to build")
    return {
        **header(names.HTTP_ROUTE),
        "metadata": build_metadata(ref, names.HTTP_ROUTE),
        "spec": {
            "parentRefs": [parent_ref(gateway)],
            "rules": [
                {
                    "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                    "backendRefs": [
                        {
                            "group": INFERENCE_GROUP,
                            "kind": "InferencePool",
                            "name": names.owned_name(ref.name, names.INFERENCE_POOL),
                        }
                    ],
                    "timeouts": {"request": REQUEST_TIMEOUT},
                }
            ],
        },
    }

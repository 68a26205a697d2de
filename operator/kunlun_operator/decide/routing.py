"""Routing decisions: which routing objects a service gets, whether the cluster can serve them, and
whether requests are routed (the ``Routed`` condition).

Owns: for ``spec.routing.type: InferencePool``, the Endpoint Picker's objects (ServiceAccount,
Role, RoleBinding, ConfigMap, Deployment, Service), the InferencePool and, with a gateway named,
the HTTPRoute, in apply order; the routing kinds that must be absent otherwise (only those of APIs
the cluster serves and the operator may use); the error naming the API a cluster lacks; and the
``Routed`` condition from the picker's Deployment and the pool's and route's status. Pure: facts
come in.
Invariant: a service routed by its Service alone gets no routing object and no ``Routed`` condition,
exactly as before routing existed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kunlun_operator import names
from kunlun_operator.builders.configmap import config_hash
from kunlun_operator.builders.httproute import build_httproute
from kunlun_operator.builders.inferencepool import build_inferencepool
from kunlun_operator.builders.picker_config import build_picker_configmap
from kunlun_operator.builders.picker_deployment import build_picker_deployment
from kunlun_operator.builders.picker_rbac import (
    build_picker_role,
    build_picker_rolebinding,
    build_picker_serviceaccount,
)
from kunlun_operator.builders.picker_service import build_picker_service
from kunlun_operator.builders.picker_tokenizer import tokenizer_dir
from kunlun_operator.decide.status import Condition, DeploymentFacts
from kunlun_operator.errors import SpecError
from kunlun_operator.spec.operator_config import PickerImages
from kunlun_operator.spec.service import ServiceRef
from kunlun_operator.spec.values import InferenceSpec

CONDITION_TYPE = "Routed"
#: How often a service waiting for the InferencePool or HTTPRoute API is checked again.
ROUTING_RECHECK_SECONDS = 60.0
_INSTALL = (
    "install the Gateway API Inference Extension's CRDs (https://gateway-api-inference-extension.sigs.k8s.io; "
    "with the kunlun-inference chart also set routing.enabled=true)"
)


def require_routing_apis(
    spec: InferenceSpec, *, inference_pool_served: bool, httproute_served: bool
) -> SpecError | None:
    """The error of a routed ``spec`` the cluster cannot serve (admission denies it, reconcile
    reports it), naming the missing API; None when it can be served."""
    routing = spec.routing
    if not routing.inference_pool:
        return None
    if not inference_pool_served:
        return SpecError(
            "spec.routing.type",
            f"InferencePool routing needs the InferencePool API ({names.INFERENCE_GROUP_VERSION}), which this "
            f"cluster does not serve or the operator may not use: {_INSTALL}, or set routing.type to Service",
            reason="InferencePoolNotInstalled",
        )
    if routing.gateway is not None and not httproute_served:
        return SpecError(
            "spec.routing.gateway",
            f"attaching the pool to Gateway {routing.gateway.name} needs the HTTPRoute API "
            f"({names.GATEWAY_GROUP_VERSION}), which this cluster does not serve: install the Gateway API "
            "CRDs (https://gateway-api.sigs.k8s.io), or leave gateway unset and route to the pool yourself",
            reason="HTTPRouteNotInstalled",
        )
    return None


def picker_image(spec: InferenceSpec, images: PickerImages) -> str:
    """The picker image: the spec's, else the operator's default for the routing's kind."""
    return spec.routing.picker.image or images.for_precise(spec.routing.precise)


def routing_objects(
    ref: ServiceRef, spec: InferenceSpec, *, images: PickerImages, image_volumes: bool
) -> list[dict[str, Any]]:
    """The routing objects of a service routed through an InferencePool (none otherwise), in apply
    order: the picker's identity and rights, its configuration, the picker, the pool, the route."""
    if not spec.routing.inference_pool:
        return []
    configmap = build_picker_configmap(
        ref, spec, tokenizer_dir=tokenizer_dir(spec, image_volumes=image_volumes)
    )
    objects = [
        build_picker_serviceaccount(ref),
        build_picker_role(ref),
        build_picker_rolebinding(ref),
        configmap,
        build_picker_deployment(
            ref,
            spec,
            image=picker_image(spec, images),
            tokenizer_image=images.precise_tokenizer,
            config_hash=config_hash(configmap["data"]),
            image_volumes=image_volumes,
        ),
        build_picker_service(ref),
        build_inferencepool(ref, spec),
    ]
    if spec.routing.gateway is not None:
        objects.append(build_httproute(ref, spec))
    return objects


def absent_routing_kinds(
    spec: InferenceSpec, *, inference_pool_served: bool, httproute_served: bool
) -> list[names.Kind]:
    """The routing kinds that must not exist for ``spec``: all of them when routed by the Service,
    the HTTPRoute when no gateway is named. Only where the operator uses the InferencePool API (it
    holds no rights on these kinds otherwise) and, for the pool and route, the cluster serves it."""
    if not inference_pool_served:
        return []
    if spec.routing.inference_pool:
        return [names.HTTP_ROUTE] if spec.routing.gateway is None and httproute_served else []
    kinds = [*names.PICKER_KINDS, names.INFERENCE_POOL]
    return [*kinds, names.HTTP_ROUTE] if httproute_served else kinds


def routed_condition(
    ref: ServiceRef,
    spec: InferenceSpec,
    picker: DeploymentFacts | None,
    pool: Mapping[str, Any] | None,
    route: Mapping[str, Any] | None = None,
) -> Condition | None:
    """``Routed`` for a service routed through an InferencePool (None otherwise): True once its
    picker has a ready replica (the picker turns ready only after reading its pool) and, with a
    gateway named, that Gateway accepted the route (``route``'s status) and the pool; the reason
    says what is missing. A Gateway rejects a route (a listener not allowing the namespace, an
    unknown sectionName) in the route's status only, never in the pool's."""
    if not spec.routing.inference_pool:
        return None
    epp = names.owned_name(ref.name, names.PICKER_DEPLOYMENT)
    pool_name = names.owned_name(ref.name, names.INFERENCE_POOL)
    if pool is None:
        return Condition(
            CONDITION_TYPE, "False", "PoolNotCreated", f"InferencePool {pool_name} does not exist yet"
        )
    if picker is None:
        return Condition(
            CONDITION_TYPE,
            "False",
            "PickerNotCreated",
            f"the endpoint picker Deployment {epp} does not exist yet",
        )
    wanted = spec.routing.picker.replicas
    if picker.ready_replicas < 1:
        return Condition(
            CONDITION_TYPE,
            "False",
            "PickerNotReady",
            f"endpoint picker {epp}: 0/{wanted} replicas ready (a picker is ready once it has read "
            f"InferencePool {pool_name}; see `kubectl logs deploy/{epp}`)",
        )
    ready = (
        f"InferencePool {pool_name} and its endpoint picker {epp} ({picker.ready_replicas}/{wanted} ready)"
    )
    gateway = spec.routing.gateway
    if gateway is None:
        return Condition(
            CONDITION_TYPE,
            "True",
            "PickerReady",
            f"{ready} route requests sent to the pool; no spec.routing.gateway: attach the pool with your own route",
        )
    where = f"{gateway.namespace or ref.namespace}/{gateway.name}"
    gateway_namespace = gateway.namespace or ref.namespace
    on_route = (
        None
        if route is None
        else gateway_verdict(route, gateway.name, gateway_namespace, pool_namespace=ref.namespace)
    )
    if on_route:
        return Condition(
            CONDITION_TYPE,
            "False",
            "GatewayRejectedRoute",
            f"Gateway {where} on HTTPRoute {names.owned_name(ref.name, names.HTTP_ROUTE)}: {on_route}",
        )
    verdict = gateway_verdict(pool, gateway.name, gateway_namespace, pool_namespace=ref.namespace)
    if verdict is None:
        return Condition(
            CONDITION_TYPE,
            "Unknown",
            "AwaitingGateway",
            f"{ready} are ready; Gateway {where} has not reported on the pool yet (does its implementation "
            "support the Gateway API Inference Extension?)",
        )
    if verdict:
        return Condition(CONDITION_TYPE, "False", "GatewayRejectedPool", f"Gateway {where}: {verdict}")
    return Condition(CONDITION_TYPE, "True", "GatewayAccepted", f"{ready} serve Gateway {where}")


def gateway_verdict(
    pool: Mapping[str, Any], gateway: str, gateway_namespace: str, *, pool_namespace: str
) -> str | None:
    """What the Gateway reported on the pool (or route) in ``status.parents``: None when it has
    not, ``""`` when it accepted it and resolved its references, else its ``reason: message`` for
    the first condition that is not True. ``pool_namespace``: the object's own namespace, which a
    parentRef without one means."""
    for parent in (pool.get("status") or {}).get("parents") or []:
        ref = parent.get("parentRef") or {}
        if ref.get("name") != gateway or (ref.get("namespace") or pool_namespace) != gateway_namespace:
            continue
        conditions = {c.get("type"): c for c in parent.get("conditions") or []}
        if not conditions:
            return None
        for type_ in ("Accepted", "ResolvedRefs"):
            condition = conditions.get(type_)
            if condition is not None and condition.get("status") != "True":
                return f"{type_} {condition.get('status')}: {condition.get('reason')}: {condition.get('message')}"
        return ""
    return None

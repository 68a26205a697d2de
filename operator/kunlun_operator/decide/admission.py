"""Admission review of a parsed KunlunInferenceService: admission policy, compatibility matrix, memory.

Owns: what the validating webhook denies and what it only warns about. Pure: the matrix and the
cluster admin's policy come in. A service outside the policy is always denied, whatever its
version policy.
Under ``Strict`` an unsupported version combination or a model that cannot fit is denied; under
``Warn`` and ``Off`` it is a warning. Invariant: a denial always names the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kunlun_operator.builders.leaderworkerset import leaderworkerset_name_error, require_leaderworkerset
from kunlun_operator.decide.allocation import require_dra
from kunlun_operator.decide.routing import require_routing_apis
from kunlun_operator.errors import SpecError
from kunlun_operator.policy.admission_policy import STRICTEST, AdmissionPolicy, check_policy
from kunlun_operator.policy.feasibility import estimate_memory
from kunlun_operator.policy.matrix import Matrix, check_versions, select_image
from kunlun_operator.spec.service import ParsedSpec
from kunlun_operator.spec.values import InferenceSpec


@dataclass(frozen=True, slots=True)
class Review:
    denial: SpecError | None = None
    warnings: tuple[str, ...] = field(default=())

    @property
    def allowed(self) -> bool:
        return self.denial is None


def review(
    spec: ParsedSpec,
    matrix: Matrix,
    default_image: str,
    policy: AdmissionPolicy = STRICTEST,
    *,
    leaderworkerset_served: bool = False,
    inference_pool_served: bool = False,
    httproute_served: bool = False,
    dra_served: bool = False,
    name: str | None = None,
) -> Review:
    """The webhook's verdict on the parsed ``spec`` (``parse_spec_or_error``): a denial naming the
    field, or warnings. ``leaderworkerset_served``: the cluster serves LeaderWorkerSet (a multi-node
    service needs it); ``inference_pool_served``, ``httproute_served``: the cluster serves
    InferencePool and HTTPRoute and the operator may use them (a routed service needs them);
    ``dra_served``: the operator may use Dynamic Resource Allocation (``--dra``) and the cluster
    serves it (a service with ``spec.resources.allocation: dra`` needs it); ``name``: the service's
    name, when known (not with ``generateName``)."""
    if isinstance(spec, SpecError):
        return Review(denial=spec)
    violation = check_policy(spec, policy)
    if violation is not None:
        return Review(denial=violation)
    missing = require_leaderworkerset(spec, leaderworkerset_served)
    if missing is not None:
        return Review(denial=missing)
    if spec.multi_node and name and (bad_name := leaderworkerset_name_error(name)) is not None:
        return Review(denial=bad_name)
    missing = require_routing_apis(
        spec, inference_pool_served=inference_pool_served, httproute_served=httproute_served
    )
    if missing is not None:
        return Review(denial=missing)
    missing = require_dra(spec, dra_served)
    if missing is not None:
        return Review(denial=missing)
    strict = spec.versions.policy == "Strict"
    warnings: list[str] = []
    if spec.versions.policy != "Off":
        image = spec.runtime.image or select_image(matrix, spec.versions, default_image)
        problems = check_versions(matrix, image, spec.versions)
        if problems and strict:
            return Review(
                denial=SpecError(
                    problems[0].field,
                    "; ".join([problems[0].message, *map(str, problems[1:])]),
                    reason=problems[0].reason,
                )
            )
        warnings += [str(p) for p in problems]
    memory = _memory_finding(spec, matrix)
    if memory is not None:
        if strict and memory.field == "spec.resources.xpus":
            return Review(denial=memory, warnings=tuple(warnings))
        warnings.append(str(memory))
    return Review(warnings=tuple(warnings))


def _memory_finding(spec: InferenceSpec, matrix: Matrix) -> SpecError | None:
    cards = matrix.card_memory_bytes
    product = spec.resources.xpu_product
    card_memory: int | None
    if product is None:
        card_memory = max(cards.values(), default=0)
    else:
        card_memory = card_memory_of(cards, product)
        if card_memory is None:
            return SpecError(
                "spec.resources.xpuProduct",
                f"card {product} is not in the matrix's card table; memory feasibility not checked",
                reason="UnknownProduct",
            )
    if not card_memory:
        return None
    estimate = estimate_memory(spec, card_memory)
    if estimate is None or estimate.fits:
        return None
    card = product or "the largest known card"
    return SpecError(
        "spec.resources.xpus",
        f"the model does not fit {estimate.cards()} × {card}: {estimate.describe()}",
        reason="InsufficientMemory",
    )


def card_memory_of(cards: Mapping[str, int], product: str) -> int | None:
    """Memory of ``product`` (a ``kunlun.dev/xpu.product`` value like ``P800-OAM``): its own entry,
    else its family's (``P800``)."""
    return cards.get(product, cards.get(product.split("-", 1)[0]))

"""The scheduler's side of a DRA claim, for tests: CEL selectors and ``matchAttribute`` evaluated
on ResourceSlice devices, as kube-scheduler's structured allocator evaluates them.

Owns: the ``device`` a selector sees (``driver``, ``attributes[domain][name]``, ``capacity``), the
Kubernetes CEL semver library's ``semver()`` and ``compareTo()`` (semver.org precedence; build
metadata ignored), and a claim's fit on one node: every selector of the request true for each
chosen device, ``count`` devices, all sharing the ``matchAttribute`` value (evaluated by grouping).
An expression that does not evaluate to a boolean raises, as it aborts an allocation.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import celpy
from celpy import celtypes

_SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-([0-9A-Za-z.-]+))?(?:\+[0-9A-Za-z.-]+)?$")


class Semver(celtypes.StringType):
    """A ``version`` attribute or ``semver("…")``: compared by precedence only."""

    def key(self) -> tuple[Any, ...]:
        match = _SEMVER.match(str(self))
        if match is None:
            raise ValueError(f"not semver: {self!s}")
        major, minor, patch, pre = match.groups()
        # a release sorts after its pre-releases; numeric identifiers below alphanumeric ones
        parts = (
            ()
            if pre is None
            else tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in pre.split("."))
        )
        return (int(major), int(minor), int(patch), pre is None, parts)


def _semver(text: celtypes.Value) -> Semver:
    if not _SEMVER.match(str(text)):
        raise ValueError(f"semver({text!s}): not a semantic version")
    return Semver(str(text))


def _compare_to(left: celtypes.Value, right: celtypes.Value) -> celtypes.IntType:
    if not isinstance(left, Semver) or not isinstance(right, Semver):
        raise TypeError("compareTo takes two versions")
    a, b = left.key(), right.key()
    return celtypes.IntType((a > b) - (a < b))


_FUNCTIONS = {"semver": _semver, "compareTo": _compare_to}


def _typed(value: Mapping[str, Any]) -> celtypes.Value:
    if "version" in value:
        return Semver(value["version"])
    if "string" in value:
        return celtypes.StringType(value["string"])
    if "int" in value:
        return celtypes.IntType(value["int"])
    return celtypes.BoolType(value["bool"])


def cel_device(driver: str, device: Mapping[str, Any]) -> celtypes.MapType:
    """What a selector sees of ``device`` of a slice of ``driver``: names without a domain are the
    driver's."""
    attributes: dict[str, dict[str, celtypes.Value]] = defaultdict(dict)
    for name, value in (device.get("attributes") or {}).items():
        domain, _, short = name.rpartition("/")
        attributes[domain or driver][short] = _typed(value)
    capacity: dict[str, dict[str, celtypes.Value]] = defaultdict(dict)
    for name, value in (device.get("capacity") or {}).items():
        domain, _, short = name.rpartition("/")
        capacity[domain or driver][short] = celtypes.StringType(value["value"])
    return celtypes.MapType(
        {
            celtypes.StringType("driver"): celtypes.StringType(driver),
            celtypes.StringType("attributes"): _nested(attributes),
            celtypes.StringType("capacity"): _nested(capacity),
        }
    )


def _nested(values: Mapping[str, Mapping[str, celtypes.Value]]) -> celtypes.MapType:
    return celtypes.MapType(
        {
            celtypes.StringType(domain): celtypes.MapType(
                {celtypes.StringType(k): v for k, v in inner.items()}
            )
            for domain, inner in values.items()
        }
    )


def selects(expression: str, driver: str, device: Mapping[str, Any]) -> bool:
    """Whether the CEL ``expression`` selects ``device`` (a ResourceSlice device of ``driver``).

    Raises:
        ValueError: the expression is no boolean for this device (an allocation would abort).
    """
    env = celpy.Environment()
    program = env.program(env.compile(expression), functions=_FUNCTIONS)
    result = program.evaluate({"device": cel_device(driver, device)})
    if not isinstance(result, celtypes.BoolType):
        raise ValueError(f"{expression!r} gave {result!r} for {device.get('name')}")
    return bool(result)


def matching_devices(request: Mapping[str, Any], resource_slice: Mapping[str, Any]) -> list[str]:
    """Names of the slice's devices every selector of the ``exactly`` ``request`` selects."""
    driver = resource_slice["spec"]["driver"]
    expressions = [s["cel"]["expression"] for s in request.get("selectors") or []]
    return [
        d["name"]
        for d in resource_slice["spec"]["devices"]
        if all(selects(e, driver, d) for e in expressions)
    ]


def allocatable_sets(claim_spec: Mapping[str, Any], resource_slice: Mapping[str, Any]) -> list[list[str]]:
    """For a claim with one ``exactly`` request: the groups of matching devices of one node that
    could serve it, one per ``matchAttribute`` value (all matching devices when there is no
    constraint), keeping only groups of at least ``count`` devices."""
    devices = claim_spec["devices"]
    (request,) = devices["requests"]
    exactly = request["exactly"]
    names = matching_devices(exactly, resource_slice)
    constraints: Sequence[Mapping[str, Any]] = devices.get("constraints") or []
    if not constraints:
        return [names] if len(names) >= exactly["count"] else []
    (constraint,) = constraints
    attribute = constraint["matchAttribute"].rpartition("/")[2]
    groups: dict[Any, list[str]] = defaultdict(list)
    by_name = {d["name"]: d for d in resource_slice["spec"]["devices"]}
    for name in names:
        value = by_name[name].get("attributes", {}).get(attribute)
        if value is not None:  # a device without the attribute fails the constraint
            groups[repr(value)].append(name)
    return [group for _, group in sorted(groups.items()) if len(group) >= exactly["count"]]

"""Which of this node's cards a ResourceClaim was allocated: read from the claim, checked, pure.

kubelet's prepare call names a claim (namespace, name, uid) but not its devices; the scheduler wrote
them into the claim's ``status.allocation.devices.results`` (each: request, driver, pool, device).
`claim_cards` keeps the results of our driver and checks each one. Every problem is a `ClaimError`
naming the claim and the field, which the servicer answers for that claim alone:
- the claim read is another object than kubelet's (its uid differs: deleted and recreated);
- no allocation, or no result of driver `xpu.kunlun.dev` (a claim for another driver);
- a result in another pool (another node's cards), or naming a device this node does not have;
- a card that is unhealthy now (kubelet retries the prepare; it succeeds once the card recovered).

Invariant: pure; returns each card once, with every request it serves, ordered by card index.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from kunlun_device.dra.slices import device_name
from kunlun_device.errors import ClaimError
from kunlun_device.labels import DRA_DRIVER
from kunlun_device.xpu.model import XpuDevice


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """A ResourceClaim as kubelet names it in a prepare or unprepare call."""

    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} ({self.uid})"


@dataclass(frozen=True, slots=True)
class ClaimCard:
    """One allocated card and the claim's requests it serves."""

    request_names: tuple[str, ...]
    device: XpuDevice


def _results(claim: Mapping[str, Any], ref: ClaimRef) -> list[Mapping[str, Any]]:
    uid = (claim.get("metadata") or {}).get("uid")
    if uid != ref.uid:
        raise ClaimError(f"claim {ref}: metadata.uid is {uid!r} (the claim was replaced)")
    allocation = (claim.get("status") or {}).get("allocation")
    if not allocation:
        raise ClaimError(f"claim {ref}: status.allocation is empty (not allocated yet)")
    results = (allocation.get("devices") or {}).get("results") or []
    if not isinstance(results, list):
        raise ClaimError(f"claim {ref}: status.allocation.devices.results is not a list")
    return [r for r in results if isinstance(r, Mapping)]


def claim_cards(
    claim: Mapping[str, Any],
    ref: ClaimRef,
    node_name: str,
    devices: Collection[XpuDevice],
    unhealthy: Collection[int],
) -> tuple[ClaimCard, ...]:
    """This node's cards allocated to `claim` (see the module docstring).

    Args:
        claim: the ResourceClaim as read from the API (a dict).
        ref: what kubelet asked for.
        node_name: this node (the pool our slice publishes).
        devices: this node's cards.
        unhealthy: indices of the cards that are unhealthy now.
    Raises:
        ClaimError: the claim cannot be prepared here (the message names why).
    """
    results = _results(claim, ref)
    ours = [r for r in results if r.get("driver") == DRA_DRIVER]
    if not ours:
        drivers = sorted({str(r.get("driver")) for r in results}) or ["none"]
        raise ClaimError(
            f"claim {ref}: no device of driver {DRA_DRIVER} allocated (drivers: {', '.join(drivers)})"
        )
    by_name = {device_name(d.index): d for d in devices}
    requests: dict[str, list[str]] = {}
    for result in ours:
        name = str(result.get("device"))
        if result.get("pool") != node_name:
            raise ClaimError(
                f"claim {ref}: device {name} is in pool {result.get('pool')!r}, not this node's {node_name!r}"
            )
        if name not in by_name:
            raise ClaimError(f"claim {ref}: device {name} does not exist on node {node_name}")
        if by_name[name].index in unhealthy:
            raise ClaimError(f"claim {ref}: device {name} ({by_name[name].uuid}) is unhealthy")
        requests.setdefault(name, []).append(str(result.get("request", "")))
    return tuple(
        ClaimCard(tuple(names), by_name[name])
        for name, names in sorted(requests.items(), key=lambda item: by_name[item[0]].index)
    )

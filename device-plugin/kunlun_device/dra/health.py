"""Device health for kubelet's DRA health stream (`v1alpha1.DRAResourceHealth/NodeWatchResources`).

The states come from the classic plugin's health code (`HealthMonitor`: the checks and the
recovery period): a card the tracker holds Unhealthy is `UNHEALTHY`; a Healthy card whose last
round could not be read (`xpu-smi` failed: a `tool-error` finding, warn-only by default) is
`UNKNOWN`; otherwise `HEALTHY`. kubelet writes them into the pod's
``status.containerStatuses[].allocatedResourcesStatus`` for the cards the pod holds.

Invariant: the stream sends every card of the node at once, then the whole list again after each
change, each card stamped with the Unix time of the round its status comes from.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from enum import StrEnum

import grpc

from kunlun_device.api import drahealth_v1alpha1_pb2 as hpb
from kunlun_device.api import drahealth_v1alpha1_pb2_grpc as hpb_grpc
from kunlun_device.dra.slices import device_name
from kunlun_device.plugin.states import DeviceStates
from kunlun_device.xpu.health import Check, Finding
from kunlun_device.xpu.health_tracker import HealthState

logger = logging.getLogger(__name__)
WAIT_SLICE_SECONDS = 0.5  # how often an idle stream checks that kubelet is still there


class DeviceHealth(StrEnum):
    HEALTHY = "Healthy"
    UNHEALTHY = "Unhealthy"
    UNKNOWN = "Unknown"


_WIRE = {
    DeviceHealth.HEALTHY: hpb.HEALTHY,
    DeviceHealth.UNHEALTHY: hpb.UNHEALTHY,
    DeviceHealth.UNKNOWN: hpb.UNKNOWN,
}


def device_health(
    states: Mapping[int, HealthState], findings: Mapping[int, tuple[Finding, ...]]
) -> dict[int, DeviceHealth]:
    """Each card's DRA health from the tracker's states and the round's findings."""
    health = {}
    for index, state in states.items():
        if state is HealthState.UNHEALTHY:
            health[index] = DeviceHealth.UNHEALTHY
        elif any(f.check is Check.TOOL_ERROR for f in findings.get(index, ())):
            health[index] = DeviceHealth.UNKNOWN
        else:
            health[index] = DeviceHealth.HEALTHY
    return health


def build_health_response(
    pool_name: str, health: Mapping[int, DeviceHealth], updated_at: int
) -> hpb.NodeWatchResourcesResponse:
    """The full list kubelet sees: every card by index, in the node's pool."""
    return hpb.NodeWatchResourcesResponse(
        devices=[
            hpb.DeviceHealth(
                device=hpb.DeviceIdentifier(pool_name=pool_name, device_name=device_name(index)),
                health=_WIRE[state],
                last_updated_time=updated_at,
            )
            for index, state in sorted(health.items())
        ]
    )


class HealthServicer(hpb_grpc.DRAResourceHealthServicer):
    """Streams the health published to `states`; `updated_at()` gives the last round's Unix time."""

    def __init__(
        self, pool_name: str, states: DeviceStates[DeviceHealth], updated_at: Callable[[], int]
    ) -> None:
        self._pool = pool_name
        self._states = states
        self._updated_at = updated_at

    def NodeWatchResources(
        self, request: hpb.NodeWatchResourcesRequest, context: grpc.ServicerContext
    ) -> Iterator[hpb.NodeWatchResourcesResponse]:
        version, health = self._states.snapshot()
        logger.info("NodeWatchResources: kubelet connected, sending %d devices", len(health))
        yield build_health_response(self._pool, health, self._updated_at())
        while context.is_active() and not self._states.closed:
            newer = self._states.wait_newer(version, WAIT_SLICE_SECONDS)
            if newer is None:
                continue
            version, health = newer
            changed = {
                device_name(i): str(h) for i, h in sorted(health.items()) if h is not DeviceHealth.HEALTHY
            }
            logger.info("NodeWatchResources: sending update, not healthy: %s", changed or "none")
            yield build_health_response(self._pool, health, self._updated_at())

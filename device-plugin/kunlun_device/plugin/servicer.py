"""The `v1beta1.DevicePlugin` gRPC service: what kubelet calls on the plugin's socket.

Device ids are card UUIDs. `Allocate` hands out `/dev/xpuN` (+ `/dev/xpuctrl`) and
`XPU_VISIBLE_DEVICES`; `GetPreferredAllocation` delegates to `allocator`; `ListAndWatch` streams
the whole list at once and again after every change published to `DeviceStates`.

Invariant: a bad request (unknown ids, impossible size) is answered with a gRPC error naming what
is wrong; it never stops the stream of another caller or the server.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import grpc

from kunlun_device.api import deviceplugin_v1beta1_pb2 as pb
from kunlun_device.api import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from kunlun_device.errors import AllocationError, UnknownDeviceError
from kunlun_device.labels import CONTROL_DEVICE, VISIBLE_DEVICES_ENV
from kunlun_device.plugin.allocator import preferred_allocation
from kunlun_device.plugin.placement import Placement
from kunlun_device.plugin.states import DeviceStates
from kunlun_device.xpu.health_tracker import HealthState
from kunlun_device.xpu.model import XpuDevice

logger = logging.getLogger(__name__)
WAIT_SLICE_SECONDS = 0.5  # how often an idle ListAndWatch checks that its caller is still there


def build_list_response(
    devices: tuple[XpuDevice, ...], placement: Placement, states: dict[int, HealthState]
) -> pb.ListAndWatchResponse:
    """The device list kubelet sees: id, health and (when known) NUMA node of each card, by index."""
    numa = {card.index: card.numa_node for card in placement.cards}
    listed = []
    for device in sorted(devices, key=lambda d: d.index):
        node = numa.get(device.index)
        topology = pb.TopologyInfo(nodes=[pb.NUMANode(ID=node)]) if node is not None else None
        health = str(states.get(device.index, HealthState.UNHEALTHY))
        listed.append(pb.Device(ID=device.uuid, health=health, topology=topology))
    return pb.ListAndWatchResponse(devices=listed)


class DevicePluginServicer(pb_grpc.DevicePluginServicer):
    """Serves one node's cards."""

    def __init__(
        self,
        devices: tuple[XpuDevice, ...],
        placement: Placement,
        states: DeviceStates[HealthState],
        control_device_present: bool,
    ) -> None:
        self._devices = {device.uuid: device for device in devices}
        self._ordered = devices
        self._placement = placement
        self._states = states
        self._control = control_device_present

    def GetDevicePluginOptions(
        self, request: pb.Empty, context: grpc.ServicerContext
    ) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    def ListAndWatch(
        self, request: pb.Empty, context: grpc.ServicerContext
    ) -> Iterator[pb.ListAndWatchResponse]:
        version, states = self._states.snapshot()
        logger.info("ListAndWatch: kubelet connected, sending %d cards", len(states))
        yield build_list_response(self._ordered, self._placement, states)
        while context.is_active() and not self._states.closed:
            newer = self._states.wait_newer(version, WAIT_SLICE_SECONDS)
            if newer is None:
                continue
            version, states = newer
            unhealthy = sorted(i for i, s in states.items() if s is HealthState.UNHEALTHY)
            logger.info("ListAndWatch: sending update, unhealthy cards %s", unhealthy)
            yield build_list_response(self._ordered, self._placement, states)

    def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        responses = []
        for container in request.container_requests:
            try:
                ids = preferred_allocation(
                    self._placement,
                    container.available_deviceIDs,
                    container.must_include_deviceIDs,
                    container.allocation_size,
                )
            except (UnknownDeviceError, AllocationError) as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            responses.append(pb.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return pb.PreferredAllocationResponse(container_responses=responses)

    def Allocate(self, request: pb.AllocateRequest, context: grpc.ServicerContext) -> pb.AllocateResponse:
        unknown = sorted(
            {i for c in request.container_requests for i in c.devices_ids if i not in self._devices}
        )
        if unknown:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(UnknownDeviceError(unknown)))
        responses = [self._allocate_one(list(c.devices_ids)) for c in request.container_requests]
        return pb.AllocateResponse(container_responses=responses)

    def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()

    def _allocate_one(self, device_ids: list[str]) -> pb.ContainerAllocateResponse:
        cards = sorted((self._devices[i] for i in device_ids), key=lambda d: d.index)
        specs = [
            pb.DeviceSpec(container_path=d.device_path, host_path=d.device_path, permissions="rw")
            for d in cards
        ]
        if self._control and cards:
            specs.append(
                pb.DeviceSpec(container_path=CONTROL_DEVICE, host_path=CONTROL_DEVICE, permissions="rw")
            )
        visible = ",".join(str(d.index) for d in cards)
        logger.info("Allocate: cards %s", visible)
        return pb.ContainerAllocateResponse(envs={VISIBLE_DEVICES_ENV: visible}, devices=specs)

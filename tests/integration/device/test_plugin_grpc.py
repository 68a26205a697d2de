"""The device plugin end to end over real unix sockets, with this test playing kubelet."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kunlun_device.api import deviceplugin_v1beta1_pb2 as pb
from kunlun_device.api import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from kunlun_device.plugin import PluginServer
from tests.integration.device.fake_kubelet import FakeKubelet, fast_plugin, short_tempdir
from tests.support.waiting import wait_for
from tests.unit.device.hosts import copy_host, use_outputs

SOCKET = "kunlun-xpu.sock"
logger = logging.getLogger(__name__)


def uuid(index: int) -> str:
    return f"GPU-7c1f{index:04x}-5a2b-5c3d-8e4f-0123456789{index:02x}"


def summary(response: pb.ListAndWatchResponse) -> list[tuple[str, str, int]]:
    return [(d.ID[-2:], d.health, d.topology.nodes[0].ID) for d in response.devices]


def unhealthy(response: pb.ListAndWatchResponse) -> set[int]:
    return {int(d.ID[-2:], 16) for d in response.devices if d.health == "Unhealthy"}


def updates_until(
    stream: Iterator[pb.ListAndWatchResponse], wanted: set[int]
) -> list[pb.ListAndWatchResponse]:
    """Read updates until the unhealthy set is `wanted` (the stream's own deadline bounds the wait).

    A fixture host switches its files one by one, so an intermediate update may show part of the
    change; every update must stay within the cards that change.
    """
    seen = [next(stream)]
    while unhealthy(seen[-1]) != wanted:
        seen.append(next(stream))
    return seen


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[Path, FakeKubelet, PluginServer]]:
    host = copy_host("p800-8", tmp_path)
    with short_tempdir() as kubelet_dir:
        kubelet = FakeKubelet(kubelet_dir)
        kubelet.start()
        plugin = fast_plugin(tmp_path, kubelet_dir)
        plugin.start()
        try:
            yield host, kubelet, plugin
        finally:
            plugin.stop()
            kubelet.stop()


def test_registers_then_streams_failure_and_recovery(node: tuple[Path, FakeKubelet, PluginServer]) -> None:
    host, kubelet, _ = node
    assert kubelet.next_registration() == pb.RegisterRequest(
        version="v1beta1",
        endpoint=SOCKET,
        resource_name="kunlunxin.com/xpu",
        options=pb.DevicePluginOptions(get_preferred_allocation_available=True),
    )
    with kubelet.plugin_channel(SOCKET) as channel:
        stub = pb_grpc.DevicePluginStub(channel)
        assert stub.GetDevicePluginOptions(pb.Empty(), timeout=10) == pb.DevicePluginOptions(
            pre_start_required=False, get_preferred_allocation_available=True
        )
        stream = stub.ListAndWatch(pb.Empty(), timeout=30)
        healthy = [(f"{i:02x}", "Healthy", i // 4) for i in range(8)]
        first = next(stream)
        assert summary(first) == healthy
        assert [d.ID for d in first.devices] == [uuid(i) for i in range(8)]
        logger.info("ListAndWatch #1: %s", summary(first))

        use_outputs(host, "p800-failing")  # card 5: uncorrectable ECC; /dev/xpu6 removed
        seen = updates_until(stream, {5, 6})
        assert all(unhealthy(update) <= {5, 6} for update in seen)
        failed = seen[-1]
        assert summary(failed) == [
            (f"{i:02x}", "Unhealthy" if i in (5, 6) else "Healthy", i // 4) for i in range(8)
        ]
        logger.info("ListAndWatch #2: %s", summary(failed))

        use_outputs(host, "p800-8")
        seen = updates_until(stream, set())
        assert all(unhealthy(update) <= {5, 6} for update in seen)
        recovered = seen[-1]
        assert summary(recovered) == healthy
        logger.info("ListAndWatch #3: %s", summary(recovered))
        stream.cancel()


def test_allocate_and_preferred_allocation(node: tuple[Path, FakeKubelet, PluginServer]) -> None:
    _, kubelet, _ = node
    kubelet.next_registration()
    with kubelet.plugin_channel(SOCKET) as channel:
        stub = pb_grpc.DevicePluginStub(channel)
        request = pb.AllocateRequest(
            container_requests=[
                pb.ContainerAllocateRequest(devices_ids=[uuid(3), uuid(0)]),
                pb.ContainerAllocateRequest(devices_ids=[uuid(6)]),
            ]
        )
        response = stub.Allocate(request, timeout=10)

        def spec(path: str) -> pb.DeviceSpec:
            return pb.DeviceSpec(container_path=path, host_path=path, permissions="rw")

        assert response == pb.AllocateResponse(
            container_responses=[
                pb.ContainerAllocateResponse(
                    envs={"XPU_VISIBLE_DEVICES": "0,3"},
                    devices=[spec("/dev/xpu0"), spec("/dev/xpu3"), spec("/dev/xpuctrl")],
                ),
                pb.ContainerAllocateResponse(
                    envs={"XPU_VISIBLE_DEVICES": "6"}, devices=[spec("/dev/xpu6"), spec("/dev/xpuctrl")]
                ),
            ]
        )
        preferred = stub.GetPreferredAllocation(
            pb.PreferredAllocationRequest(
                container_requests=[
                    pb.ContainerPreferredAllocationRequest(
                        available_deviceIDs=[uuid(i) for i in (0, 1, 2, 3, 5, 6, 7)],
                        must_include_deviceIDs=[],
                        allocation_size=2,
                    ),
                    pb.ContainerPreferredAllocationRequest(
                        available_deviceIDs=[uuid(i) for i in range(8)],
                        must_include_deviceIDs=[uuid(4)],
                        allocation_size=4,
                    ),
                ]
            ),
            timeout=10,
        )
        assert [list(r.deviceIDs) for r in preferred.container_responses] == [
            [uuid(5), uuid(6)],
            [uuid(4), uuid(5), uuid(6), uuid(7)],
        ]
        assert stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=[uuid(0)]), timeout=10) == (
            pb.PreStartContainerResponse()
        )


def test_unknown_ids_are_a_grpc_error_naming_them(node: tuple[Path, FakeKubelet, PluginServer]) -> None:
    _, kubelet, _ = node
    with kubelet.plugin_channel(SOCKET) as channel:
        stub = pb_grpc.DevicePluginStub(channel)
        bad = pb.AllocateRequest(
            container_requests=[pb.ContainerAllocateRequest(devices_ids=[uuid(1), "GPU-x"])]
        )
        with pytest.raises(grpc.RpcError) as caught:
            stub.Allocate(bad, timeout=10)
        assert (caught.value.code(), caught.value.details()) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "unknown device ids: GPU-x",
        )
        too_big = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(available_deviceIDs=[uuid(1)], allocation_size=2)
            ]
        )
        with pytest.raises(grpc.RpcError) as caught:
            stub.GetPreferredAllocation(too_big, timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details() == "allocation_size 2 impossible with 0 must-include and 1 free cards"
        # the server is still fine after bad requests
        assert stub.GetDevicePluginOptions(pb.Empty(), timeout=10).get_preferred_allocation_available


def test_registers_again_when_kubelet_restarts(node: tuple[Path, FakeKubelet, PluginServer]) -> None:
    _, kubelet, plugin = node
    kubelet.next_registration()
    kubelet.restart()  # removes kubelet.sock and the plugin's socket, serves a new kubelet.sock
    again = kubelet.next_registration()
    assert (again.endpoint, again.resource_name) == (SOCKET, "kunlunxin.com/xpu")
    wait_for(lambda: plugin.registrations == 2, timeout_seconds=20, message="the plugin to register again")
    with kubelet.plugin_channel(SOCKET) as channel:
        stream = pb_grpc.DevicePluginStub(channel).ListAndWatch(pb.Empty(), timeout=30)
        assert [d.health for d in next(stream).devices] == ["Healthy"] * 8
        stream.cancel()

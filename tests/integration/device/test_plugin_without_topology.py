"""The plugin on nodes whose `xpu-smi topo -m` is missing or unreadable and whose sysfs has no NUMA.

Topology is optional: the plugin must still register, list every card Healthy without NUMA topology,
answer `GetPreferredAllocation` and `Allocate`, and say once which cards lack a NUMA node and why.
This test plays kubelet over the real gRPC protocol on unix sockets.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from kunlun_device.api import deviceplugin_v1beta1_pb2 as pb
from kunlun_device.api import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from kunlun_device.plugin import PluginServer
from kunlun_device.xpu.health import HealthPolicy
from tests.integration.device.fake_kubelet import FakeKubelet, short_tempdir
from tests.unit.device.hosts import make_source

SOCKET = "kunlun-xpu.sock"
HOSTS = {
    "p800-no-topo": "exit status 1: xpu-smi: unknown command 'topo'",
    "p800-topo-pairs": "xpu-smi topo -m: link cells do not match the header at line 4",
}


def uuid(index: int) -> str:
    return f"GPU-7c1f{index:04x}-5a2b-5c3d-8e4f-0123456789{index:02x}"


def spec(path: str) -> pb.DeviceSpec:
    return pb.DeviceSpec(container_path=path, host_path=path, permissions="rw")


def preferred(available: list[int], must: list[int], size: int) -> pb.ContainerPreferredAllocationRequest:
    return pb.ContainerPreferredAllocationRequest(
        available_deviceIDs=[uuid(i) for i in available],
        must_include_deviceIDs=[uuid(i) for i in must],
        allocation_size=size,
    )


@pytest.fixture(params=sorted(HOSTS))
def node(
    request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> Iterator[tuple[str, FakeKubelet]]:
    caplog.set_level(logging.WARNING, logger="kunlun_device")
    with short_tempdir() as kubelet_dir:
        kubelet = FakeKubelet(kubelet_dir)
        kubelet.start()
        plugin = PluginServer(
            make_source(request.param), kubelet_dir, SOCKET, HealthPolicy(), health_interval_seconds=3600
        )
        plugin.start()
        try:
            yield request.param, kubelet
        finally:
            plugin.stop()
            kubelet.stop()


def test_registers_and_lists_every_card_healthy_without_topology(node: tuple[str, FakeKubelet]) -> None:
    _, kubelet = node
    registration = kubelet.next_registration()
    assert (registration.resource_name, registration.endpoint) == ("kunlunxin.com/xpu", SOCKET)
    with kubelet.plugin_channel(SOCKET) as channel:
        stream = pb_grpc.DevicePluginStub(channel).ListAndWatch(pb.Empty(), timeout=30)
        listed = next(stream)
        stream.cancel()
    assert listed == pb.ListAndWatchResponse(
        devices=[pb.Device(ID=uuid(i), health="Healthy") for i in range(8)]
    )
    assert not any(device.HasField("topology") for device in listed.devices)


def test_preferred_allocation_and_allocate_still_answer(node: tuple[str, FakeKubelet]) -> None:
    _, kubelet = node
    kubelet.next_registration()
    with kubelet.plugin_channel(SOCKET) as channel:
        stub = pb_grpc.DevicePluginStub(channel)
        answer = stub.GetPreferredAllocation(
            pb.PreferredAllocationRequest(
                container_requests=[
                    preferred(list(range(8)), [], 2),
                    preferred([0, 1, 2, 3, 5, 6, 7], [], 2),
                    preferred(list(range(8)), [4], 4),
                    preferred(list(range(8)), [], 8),
                ]
            ),
            timeout=10,
        )
        # no NUMA and no XPU Link known: an 8-card P800 node is split by index (cards 0-3, 4-7)
        assert [list(r.deviceIDs) for r in answer.container_responses] == [
            [uuid(0), uuid(1)],
            [uuid(5), uuid(6)],
            [uuid(i) for i in (4, 5, 6, 7)],
            [uuid(i) for i in range(8)],
        ]
        allocated = stub.Allocate(
            pb.AllocateRequest(
                container_requests=[pb.ContainerAllocateRequest(devices_ids=[uuid(7), uuid(2)])]
            ),
            timeout=10,
        )
    assert allocated == pb.AllocateResponse(
        container_responses=[
            pb.ContainerAllocateResponse(
                envs={"XPU_VISIBLE_DEVICES": "2,7"},
                devices=[spec("/dev/xpu2"), spec("/dev/xpu7"), spec("/dev/xpuctrl")],
            )
        ]
    )


def test_unknown_numa_is_warned_once_naming_cards_and_why(
    node: tuple[str, FakeKubelet], caplog: pytest.LogCaptureFixture
) -> None:
    host, kubelet = node
    kubelet.next_registration()
    messages = [r.getMessage() for r in caplog.get_records("setup") + caplog.records]  # start() ran in setup
    numa = [m for m in messages if m.startswith("NUMA node unknown")]
    assert len(numa) == 1
    cards = ", ".join(f"xpu{i}" for i in range(8))
    assert numa[0].startswith(f"NUMA node unknown for {cards} (sysfs has no numa_node for them and the ")
    assert HOSTS[host] in numa[0]
    links = [m for m in messages if m.startswith("no card topology")]
    assert len(links) == 1 and HOSTS[host] in links[0]

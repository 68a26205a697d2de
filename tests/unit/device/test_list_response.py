"""The device list sent on ListAndWatch: ids, health, and NUMA topology only when it is known."""

from __future__ import annotations

from dataclasses import replace

from kunlun_device.api import deviceplugin_v1beta1_pb2 as pb
from kunlun_device.plugin.placement import build_placement
from kunlun_device.plugin.servicer import build_list_response
from kunlun_device.xpu.health_tracker import HealthState
from tests.unit.device.hosts import make_source


def test_list_has_numa_topology_and_health() -> None:
    devices = make_source("p800-8").list_devices()[3:5]
    response = build_list_response(
        devices, build_placement(devices, None), {3: HealthState.HEALTHY, 4: HealthState.UNHEALTHY}
    )
    assert response == pb.ListAndWatchResponse(
        devices=[
            pb.Device(
                ID=devices[0].uuid, health="Healthy", topology=pb.TopologyInfo(nodes=[pb.NUMANode(ID=0)])
            ),
            pb.Device(
                ID=devices[1].uuid, health="Unhealthy", topology=pb.TopologyInfo(nodes=[pb.NUMANode(ID=1)])
            ),
        ]
    )


def test_unknown_numa_is_not_invented() -> None:
    devices = tuple(replace(d, numa_node=None) for d in make_source("p800-8").list_devices())
    response = build_list_response(
        devices, build_placement(devices, None), dict.fromkeys(range(8), HealthState.HEALTHY)
    )
    assert [d.HasField("topology") for d in response.devices] == [False] * 8
    assert [d.health for d in response.devices] == ["Healthy"] * 8

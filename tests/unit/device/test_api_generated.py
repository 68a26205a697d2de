"""The committed gRPC code under kunlun_device/api is exactly what grpcio-tools generates now."""

from __future__ import annotations

from pathlib import Path

import pytest

from kunlun_device.api import deviceplugin_v1beta1_pb2 as pb
from kunlun_device.api import regenerate


@pytest.mark.parametrize("proto", regenerate.PROTOS)
def test_committed_code_matches_regeneration(proto: str, tmp_path: Path) -> None:
    regenerate.regenerate(tmp_path)
    stem = proto.removesuffix(".proto")
    for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
        fresh = (tmp_path / "kunlun_device" / "api" / f"{stem}{suffix}").read_text()
        committed = (regenerate.API_DIR / f"{stem}{suffix}").read_text()
        assert fresh == committed, f"{stem}{suffix} is stale: run python -m kunlun_device.api.regenerate"


def test_wire_names_are_kubelets() -> None:
    services = pb.DESCRIPTOR.services_by_name
    assert services["Registration"].full_name == "v1beta1.Registration"
    assert [m.name for m in services["DevicePlugin"].methods] == [
        "GetDevicePluginOptions",
        "ListAndWatch",
        "GetPreferredAllocation",
        "Allocate",
        "PreStartContainer",
    ]
    request = pb.ContainerPreferredAllocationRequest(
        available_deviceIDs=["a", "b"], must_include_deviceIDs=["a"], allocation_size=2
    )
    # field numbers 1, 2, 3 with kubelet's wire types: two length-delimited strings, one varint
    assert request.SerializeToString() == b"\n\x01a\n\x01b\x12\x01a\x18\x02"


def test_dra_wire_names_are_kubelets() -> None:
    from kunlun_device.api import (
        dra_v1_pb2,
        dra_v1beta1_pb2,
        drahealth_v1alpha1_pb2,
        pluginregistration_v1_pb2,
    )

    full_names = {
        module.DESCRIPTOR.services_by_name[name].full_name: [
            m.name for m in module.DESCRIPTOR.services_by_name[name].methods
        ]
        for module, name in (
            (dra_v1_pb2, "DRAPlugin"),
            (dra_v1beta1_pb2, "DRAPlugin"),
            (drahealth_v1alpha1_pb2, "DRAResourceHealth"),
            (pluginregistration_v1_pb2, "Registration"),
        )
    }
    assert full_names == {
        "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin": ["NodePrepareResources", "NodeUnprepareResources"],
        "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin": ["NodePrepareResources", "NodeUnprepareResources"],
        "v1alpha1.DRAResourceHealth": ["NodeWatchResources"],
        "pluginregistration.Registration": ["GetInfo", "NotifyRegistrationStatus"],
    }
    device = dra_v1_pb2.Device(request_names=["r"], pool_name="p", device_name="d", cdi_device_ids=["c"])
    # fields 1..4, all length-delimited strings
    assert device.SerializeToString() == b"\n\x01r\x12\x01p\x1a\x01d\x22\x01c"
    health = drahealth_v1alpha1_pb2.DeviceHealth(
        device=drahealth_v1alpha1_pb2.DeviceIdentifier(pool_name="p", device_name="d"),
        health=drahealth_v1alpha1_pb2.UNHEALTHY,
        last_updated_time=5,
    )
    assert health.SerializeToString() == b"\n\x06\n\x01p\x12\x01d\x10\x02\x18\x05"
    info = pluginregistration_v1_pb2.PluginInfo(type="t", name="n", endpoint="e", supported_versions=["v"])
    assert info.SerializeToString() == b"\n\x01t\x12\x01n\x1a\x01e\x22\x01v"

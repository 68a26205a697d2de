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

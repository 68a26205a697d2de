"""The device-plugin image: registers with a fake kubelet through a mounted socket folder and
serves ListAndWatch for the fixture host's eight cards, as the chart's DaemonSet runs it (root,
kubelet's device-plugin folder and the host's xpu-smi mounted)."""

from __future__ import annotations

import pytest

from kunlun_device.api import deviceplugin_v1beta1_pb2 as pb
from kunlun_device.api import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from tests.images.conftest import REPO, Podman
from tests.integration.device.fake_kubelet import FakeKubelet, short_tempdir

pytestmark = pytest.mark.slow
HOST = REPO / "tests" / "fixtures" / "xpu" / "p800-8"


def test_the_plugin_image_registers_and_lists_the_cards(
    podman: Podman, device_plugin_image: str, container: list[str]
) -> None:
    with short_tempdir() as kubelet_dir:
        kubelet = FakeKubelet(kubelet_dir)
        kubelet.start()
        name = podman.container_name("device-plugin")
        container.append(name)
        podman(
            "run", "--detach", "--name", name, "--network", "none", "--read-only", "--user", "0:0",
            "--volume", f"{kubelet_dir}:/var/lib/kubelet/device-plugins",
            "--volume", f"{HOST}:/host:ro",
            device_plugin_image,
            "plugin", "--xpu-smi", "/host/xpu-smi", "--dev-root", "/host/root",
            "--kubelet-dir", "/var/lib/kubelet/device-plugins", "--health-interval", "0.5",
        )  # fmt: skip
        try:
            try:
                request = kubelet.next_registration(timeout_seconds=60)
            except Exception:
                print(podman("logs", name, check=False).stderr)
                raise
            assert (request.resource_name, request.endpoint) == ("kunlunxin.com/xpu", "kunlun-xpu.sock")
            with kubelet.plugin_channel(request.endpoint) as channel:
                stream = pb_grpc.DevicePluginStub(channel).ListAndWatch(pb.Empty(), timeout=30)
                first = next(stream)
                stream.cancel()
        finally:
            podman("stop", "--time", "10", name, check=False)
            kubelet.stop()
    assert [(d.health, d.topology.nodes[0].ID) for d in first.devices] == [
        ("Healthy", i // 4) for i in range(8)
    ]
    assert podman("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip() == "0"

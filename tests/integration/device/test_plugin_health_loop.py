"""The plugin's health thread with a fault responder: registration never waits for it, a failing
responder never stops it, and the responder's API client gives up at once on an unreachable API.

Plays kubelet over real gRPC (``FakeKubelet``); the responder is a stand-in whose ``act`` raises.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from kunlun_device.api import deviceplugin_v1beta1_pb2 as pb
from kunlun_device.api import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from kunlun_device.cli import _api_client
from kunlun_device.plugin import PluginServer
from kunlun_device.xpu.health_tracker import HealthState
from kunlun_device.xpu.model import XpuDevice
from kunlun_device.xpu.monitor import HealthSnapshot
from tests.integration.device.fake_kubelet import FakeKubelet, fast_plugin, short_tempdir
from tests.integration.device.test_fault_response import BOUND_SECONDS, SOCKET, set_table
from tests.support.waiting import wait_for
from tests.unit.device.hosts import copy_host


class BrokenResponder:
    """A fault responder whose ``act`` always fails with an error nobody expects."""

    def __init__(self, plugin: Callable[[], PluginServer]) -> None:
        self.plugin = plugin
        self.acts = 0
        self.registrations_at_first_act: int | None = None

    def observe(self, snapshot: HealthSnapshot) -> dict[int, HealthState]:
        return snapshot.states

    def act(self, publish: Callable[[dict[int, HealthState]], object]) -> dict[int, HealthState]:
        if self.registrations_at_first_act is None:
            self.registrations_at_first_act = self.plugin().registrations
        self.acts += 1
        raise ValueError("a bug in the fault response")


def list_and_watch(kubelet: FakeKubelet) -> dict[int, str]:
    with kubelet.plugin_channel(SOCKET) as channel:
        stream = pb_grpc.DevicePluginStub(channel).ListAndWatch(pb.Empty(), timeout=10)
        first = next(stream)
        stream.cancel()
    return {int(d.ID[-2:], 16): d.health for d in first.devices}


def test_a_responder_that_raises_neither_delays_registration_nor_stops_the_health_loop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="kunlun_device")
    host = copy_host("p800-8", tmp_path)
    responders: list[BrokenResponder] = []

    def respond(devices: tuple[XpuDevice, ...]) -> BrokenResponder:
        responders.append(BrokenResponder(lambda: plugin))
        return responders[0]

    with short_tempdir() as kubelet_dir:
        kubelet = FakeKubelet(kubelet_dir)
        kubelet.start()
        plugin = fast_plugin(tmp_path, kubelet_dir, fault_response=respond)
        try:
            plugin.start()
            assert plugin.registrations == 1
            wait_for(lambda: responders[0].acts >= 2, timeout_seconds=BOUND_SECONDS, message="two rounds")
            assert responders[0].registrations_at_first_act == 1  # act never ran before registration
            set_table(host, "p800-failing")  # card 5: uncorrectable ECC errors
            wait_for(
                lambda: list_and_watch(kubelet)[5] == "Unhealthy",
                timeout_seconds=BOUND_SECONDS,
                message="card 5 withdrawn although every act failed",
            )
        finally:
            plugin.stop()
            kubelet.stop()
    assert "fault response failed this round" in caplog.text


def test_the_fault_responders_api_client_does_not_retry(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'http://127.0.0.1:9'}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
    )
    no_retries = _api_client(str(kubeconfig), retries=False)
    assert no_retries.configuration.retries is False
    assert no_retries.rest_client.pool_manager.connection_pool_kw["retries"].total is False
    assert _api_client(str(kubeconfig)).configuration.retries is None  # the labeler keeps the default

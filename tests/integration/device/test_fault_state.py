"""What the fault response keeps across a plugin restart, and how it fails when the API does not
answer: the plugin (restarted for real: a new `PluginServer` and responder, nothing in memory), the
fake kubelet over real gRPC and the fake Kubernetes API over real HTTP.

- failure counts live on the Node (`kunlun.dev/xpu-failures`): two failures, a restart, one more
  failure quarantine the card (`--quarantine-failures 3`);
- a restart with the API unreachable holds only the card its state file says is quarantined
  Unhealthy; once the API answers the Node's annotation decides (here: re-admitted meanwhile);
- a denied `pods/status` patch is logged once per pod, counted, and retried until it is allowed.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import kubernetes
import pytest

from kunlun_device.errors import FaultStateError
from kunlun_device.faults import FaultResponder, QuarantinePolicy, read_state_file
from kunlun_device.faults.history import parse_failures
from kunlun_device.faults.state import FaultState
from kunlun_device.labels import FAILURES_ANNOTATION, QUARANTINE_ANNOTATION
from kunlun_device.plugin import PluginServer
from kunlun_device.podresources import PodResourcesClient
from kunlun_device.xpu.model import XpuDevice
from tests.integration.device.fake_kubelet import FakeKubelet, fast_plugin
from tests.integration.device.test_fault_response import (
    BOUND_SECONDS,
    World,
    condition_becomes,
    fail_and_recover,
    list_and_watch,
    running_world,
    uuid,
)
from tests.support.kubeapi import RunningKubeAPI
from tests.support.waiting import wait_for
from tests.unit.device.hosts import copy_host


@dataclass
class Cluster:
    """One node's kubelet and API; `start_plugin` starts a fresh plugin process's worth of objects."""

    tmp: Path
    host: Path
    world: World
    state_file: Path
    quarantine_file: Path
    plugins: list[PluginServer] = field(default_factory=list)
    plugin: PluginServer | None = None

    @property
    def kube(self) -> RunningKubeAPI:
        return self.world.kube

    @property
    def kubelet(self) -> FakeKubelet:
        return self.world.kubelet

    def start_plugin(self, api: kubernetes.client.ApiClient | None = None) -> PluginServer:
        core = kubernetes.client.CoreV1Api(api or self.kube.client())

        def respond(devices: tuple[XpuDevice, ...]) -> FaultResponder:
            return FaultResponder(
                devices,
                "n1",
                core,
                PodResourcesClient(str(self.world.pod_resources.socket)),
                QuarantinePolicy(max_failures=3, window_seconds=600),
                node_sync_seconds=0.05,
                quarantine_file=self.quarantine_file,
                state_file=self.state_file,
            )

        plugin = fast_plugin(self.tmp, self.world.kubelet_dir, fault_response=respond)
        self.plugin = plugin
        self.plugins.append(plugin)
        plugin.start()
        return plugin

    def stop_plugin(self) -> None:
        assert self.plugin is not None
        self.plugin.stop()

    def annotations(self) -> dict[str, str]:
        return self.kube.objects("nodes")[0]["metadata"].get("annotations") or {}

    def exported(self) -> FaultState:
        """What the exporter reads (the plugin's quarantine file)."""
        return read_state_file(self.quarantine_file)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    host = copy_host("p800-8", tmp_path)
    with running_world(tmp_path) as world:
        state = Cluster(tmp_path, host, world, tmp_path / "state.json", tmp_path / "q.json")
        try:
            yield state
        finally:
            for plugin in state.plugins:
                plugin.stop()


def unreachable_client(kube: RunningKubeAPI) -> kubernetes.client.ApiClient:
    """A client of the fake API whose host is, for now, a local port nobody listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # built by hand: a client loaded from a kubeconfig re-applies the kubeconfig's host on every call
    configuration = kubernetes.client.Configuration(host=f"http://127.0.0.1:{port}")
    configuration.retries = False  # as the plugin's own client (cli): one try per call
    return kubernetes.client.ApiClient(configuration)


def test_a_restarted_plugin_keeps_counting_failures(cluster: Cluster) -> None:
    cluster.start_plugin()
    fail_and_recover(cluster)
    fail_and_recover(cluster)
    wait_for(
        lambda: len(read_failures(cluster).get(uuid(5), ())) == 2,
        timeout_seconds=BOUND_SECONDS,
        message="two failures of card 5 on the Node",
    )
    cluster.stop_plugin()
    cluster.state_file.unlink()  # the Node alone must carry the count

    cluster.start_plugin()
    fail_and_recover(cluster)  # one failure after the restart: the third in the window
    wait_for(
        lambda: cluster.annotations().get(QUARANTINE_ANNOTATION) == uuid(5),
        timeout_seconds=BOUND_SECONDS,
        message="card 5 quarantined",
    )
    assert list_and_watch(cluster) == {i: "Unhealthy" if i == 5 else "Healthy" for i in range(8)}
    condition_becomes(cluster.kube, "qwen-0", "False", "XpuQuarantined")
    wait_for(
        lambda: FAILURES_ANNOTATION not in cluster.annotations(),
        timeout_seconds=BOUND_SECONDS,
        message="count served",
    )


def read_failures(cluster: Cluster) -> dict[str, tuple[float, ...]]:
    return parse_failures(cluster.annotations().get(FAILURES_ANNOTATION))


def test_unreachable_api_at_start_holds_only_the_quarantined_card_until_the_node_answers(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    cluster.start_plugin()
    for _ in range(3):
        fail_and_recover(cluster)
    wait_for(
        lambda: read_state_file(cluster.state_file).quarantined == {uuid(5)},
        timeout_seconds=BOUND_SECONDS,
        message="card 5 quarantined in the state file",
    )
    cluster.stop_plugin()

    caplog.clear()
    client = unreachable_client(cluster.kube)
    cluster.start_plugin(client)  # restarted while the API server cannot be reached
    assert list_and_watch(cluster) == {i: "Unhealthy" if i == 5 else "Healthy" for i in range(8)}
    wait_for(
        lambda: cluster.exported().api_errors["get_node"] >= 2,
        timeout_seconds=BOUND_SECONDS,
        message="two failed reads of the Node",
    )
    assert not cluster.exported().node_read  # visible: kunlun_xpu_fault_node_read 0
    assert cluster.exported().quarantined == {uuid(5)}
    assert list_and_watch(cluster) == {i: "Unhealthy" if i == 5 else "Healthy" for i in range(8)}
    held = [r.getMessage() for r in caplog.records if "holding" in r.getMessage()]
    assert held == [
        f"until node n1 is read, holding xpu5 ({uuid(5)}) Unhealthy as quarantined in the last-known state "
        f"{cluster.state_file}"
    ]
    assert len([r for r in caplog.records if r.getMessage().startswith("get_node n1 failed")]) == 1

    # an operator re-admits the card while the plugin cannot see it; then the API answers again
    core = kubernetes.client.CoreV1Api(cluster.kube.client())
    core.patch_node("n1", {"metadata": {"annotations": {QUARANTINE_ANNOTATION: None}}})
    client.configuration.host = cluster.kube.url
    wait_for(lambda: cluster.exported().node_read, timeout_seconds=BOUND_SECONDS, message="the Node read")
    wait_for(
        lambda: list_and_watch(cluster) == dict.fromkeys(range(8), "Healthy"),
        timeout_seconds=BOUND_SECONDS,
        message="card 5 re-admitted",
    )
    condition_becomes(cluster.kube, "qwen-0", "True", "XpuHealthy")
    assert read_state_file(cluster.state_file).quarantined == frozenset()


def test_a_denied_pod_status_patch_is_logged_once_counted_and_retried(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kunlun_device")
    denial = cluster.kube.fail("patch", "pods", status=403, times=None, subresource="status")
    cluster.start_plugin()
    wait_for(
        lambda: cluster.exported().api_errors["patch_pod_status"] >= 6,
        timeout_seconds=BOUND_SECONDS,
        message="three rounds of denied patches",
        ignoring=(FaultStateError,),  # not written yet
    )
    assert cluster.exported().pods_unwritten == 2
    denied = [r.getMessage() for r in caplog.records if r.getMessage().startswith("patch_pod_status")]
    assert denied == [
        f"patch_pod_status bank-prod/{pod} failed, condition not written, retried every round: "
        f"HTTP 403 Forbidden: injected 403 for patch pods/status"
        for pod in ("qwen-0", "qwen-1")
    ]  # once per pod, however many rounds
    cluster.kube.clear_faults()  # RBAC fixed
    condition_becomes(cluster.kube, "qwen-0", "True", "XpuHealthy")
    condition_becomes(cluster.kube, "qwen-1", "True", "XpuHealthy")
    wait_for(
        lambda: cluster.exported().pods_unwritten == 0, timeout_seconds=BOUND_SECONDS, message="none left"
    )
    assert denial.fired == cluster.exported().api_errors["patch_pod_status"]

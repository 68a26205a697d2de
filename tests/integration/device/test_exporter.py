"""The exporter over HTTP, parsed by prometheus_client, with a fake kubelet PodResources server."""

from __future__ import annotations

import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kunlun_device.api import podresources_v1_pb2 as pr
from kunlun_device.api import podresources_v1_pb2_grpc as pr_grpc
from kunlun_device.exporter import Exporter
from kunlun_device.faults.state import FaultState, dump_state, write_state_file
from kunlun_device.xpu.health import HealthPolicy
from tests.integration.device.fake_kubelet import short_tempdir
from tests.unit.device.hosts import copy_host, make_source, use_outputs

GIB = 1024**3


def uuid(index: int) -> str:
    return f"GPU-7c1f{index:04x}-5a2b-5c3d-8e4f-0123456789{index:02x}"


class FakePodResources(pr_grpc.PodResourcesListerServicer):
    """kubelet's PodResources: one serving pod holds cards 4 and 5; a GPU pod is unrelated."""

    def List(
        self, request: pr.ListPodResourcesRequest, context: grpc.ServicerContext
    ) -> pr.ListPodResourcesResponse:
        xpus = pr.ContainerDevices(resource_name="kunlunxin.com/xpu", device_ids=[uuid(4), uuid(5)])
        gpus = pr.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=[uuid(0)])
        return pr.ListPodResourcesResponse(
            pod_resources=[
                pr.PodResources(
                    name="qwen-7b-chat-5d8f9-abcde",
                    namespace="bank-prod",
                    containers=[
                        pr.ContainerResources(name="sidecar"),
                        pr.ContainerResources(name="runtime", devices=[xpus], cpu_ids=[3, 4]),
                    ],
                ),
                pr.PodResources(
                    name="other", namespace="ml", containers=[pr.ContainerResources(name="c", devices=[gpus])]
                ),
            ]
        )


@pytest.fixture
def pod_resources_socket() -> Iterator[str]:
    with short_tempdir() as folder:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pr_grpc.add_PodResourcesListerServicer_to_server(FakePodResources(), server)
        socket = folder / "kubelet.sock"
        server.add_insecure_port(f"unix://{socket}")
        server.start()
        try:
            yield str(socket)
        finally:
            server.stop(grace=None).wait()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    parsed = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            parsed[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return parsed


def card(index: int, holder: tuple[str, str, str] = ("", "", "")) -> tuple[tuple[str, str], ...]:
    labels = {"device": f"xpu{index}", "uuid": uuid(index), "node": "node-a"}
    labels |= dict(zip(("namespace", "pod", "container"), holder, strict=True))
    return tuple(sorted(labels.items()))


def test_metrics_over_http_with_pod_attribution(tmp_path: Path, pod_resources_socket: str) -> None:
    copy_host("p800-8", tmp_path)
    exporter = Exporter(make_source("p800-8", tmp_path), "node-a", HealthPolicy(), 3600, pod_resources_socket)
    exporter.start()
    port = exporter.serve("127.0.0.1", 0)
    try:
        text = scrape(port)
    finally:
        exporter.stop()
    got = samples(text)
    holder = ("bank-prod", "qwen-7b-chat-5d8f9-abcde", "runtime")
    assert {k: v for k, v in got.items() if k[1] == card(4, holder)} == {
        ("kunlun_xpu_utilization_ratio", card(4, holder)): 0.87,
        ("kunlun_xpu_memory_used_bytes", card(4, holder)): 60 * GIB,
        ("kunlun_xpu_memory_total_bytes", card(4, holder)): 96 * GIB,
        ("kunlun_xpu_temperature_celsius", card(4, holder)): 49.0,
        ("kunlun_xpu_power_watts", card(4, holder)): 89.0,
        ("kunlun_xpu_ecc_errors_total", card(4, holder)): 0.0,
        ("kunlun_xpu_healthy", card(4, holder)): 1.0,
        ("kunlun_xpu_quarantined", card(4, holder)): 0.0,
    }
    assert got[("kunlun_xpu_utilization_ratio", card(5, holder))] == 0.91
    assert got[("kunlun_xpu_utilization_ratio", card(0))] == 0.0  # card 0 is held by nobody
    info = {"device": "xpu2", "uuid": uuid(2), "node": "node-a", "product": "P800 OAM"}
    info |= {"driver_version": "5.0.21.26", "runtime_version": "5.0.21", "firmware_version": "1.0.2.14.1.54"}
    info |= {"kml_version": "3.2.0"}
    assert got[("kunlun_xpu_info", tuple(sorted(info.items())))] == 1.0
    assert got[("kunlun_xpu_tool_errors_total", (("node", "node-a"),))] == 0.0
    names = {name for name, _ in got}
    assert names == {
        "kunlun_xpu_utilization_ratio",
        "kunlun_xpu_memory_used_bytes",
        "kunlun_xpu_memory_total_bytes",
        "kunlun_xpu_temperature_celsius",
        "kunlun_xpu_power_watts",
        "kunlun_xpu_ecc_errors_total",
        "kunlun_xpu_healthy",
        "kunlun_xpu_quarantined",
        "kunlun_xpu_info",
        "kunlun_xpu_tool_errors_total",
    }
    print("\n".join(line for line in text.splitlines() if "xpu4" in line or line.startswith("# ")))


def test_failing_cards_findings_and_transitions(tmp_path: Path) -> None:
    host = copy_host("p800-8", tmp_path)
    exporter = Exporter(make_source("p800-8", tmp_path), "node-a", HealthPolicy(recovery_seconds=3600), 3600)
    exporter.start()
    use_outputs(host, "p800-failing")
    exporter.refresh()
    got = samples(scrape_registry(exporter))
    assert [got[("kunlun_xpu_healthy", card(i))] for i in range(8)] == [1, 1, 1, 1, 1, 0, 0, 1]
    assert got[("kunlun_xpu_ecc_errors_total", card(5))] == 3
    findings = {k[1]: v for k, v in got.items() if k[0] == "kunlun_xpu_health_finding"}
    ids = {"node": "node-a"}
    assert findings == {
        tuple(sorted((ids | {"device": f"xpu{i}", "uuid": uuid(i), "check": c, "severity": s}).items())): 1.0
        for i, c, s in [
            (2, "temperature-high", "warn"),
            (5, "ecc-uncorrectable", "unhealthy"),
            (6, "device-node-missing", "unhealthy"),
        ]
    }
    transitions = {k[1]: v for k, v in got.items() if k[0] == "kunlun_xpu_health_transitions_total"}
    assert transitions == {
        tuple(sorted((ids | {"device": f"xpu{i}", "uuid": uuid(i), "state": "Unhealthy"}).items())): 1.0
        for i in (5, 6)
    }
    (host / "outputs" / "table.exit").write_text("9\n")
    exporter.refresh()
    got = samples(scrape_registry(exporter))
    # no readings when xpu-smi failed: samples are left out, not zero
    assert not [k for k in got if k[0] == "kunlun_xpu_temperature_celsius"]
    assert got[("kunlun_xpu_tool_errors_total", (("node", "node-a"),))] == 1


@pytest.mark.parametrize("host", ["p800-no-topo", "p800-topo-pairs"])
def test_node_without_topology_exports_every_card(host: str) -> None:
    exporter = Exporter(make_source(host), "node-a", HealthPolicy(), 3600)
    exporter.start()
    exporter.stop()
    got = samples(scrape_registry(exporter))
    assert [got[("kunlun_xpu_healthy", card(i))] for i in range(8)] == [1.0] * 8
    assert got[("kunlun_xpu_utilization_ratio", card(5))] == 0.91
    assert got[("kunlun_xpu_tool_errors_total", (("node", "node-a"),))] == 0.0


def test_quarantine_and_fault_response_health_from_the_plugins_file(tmp_path: Path) -> None:
    quarantine = tmp_path / "quarantine.json"
    exporter = Exporter(make_source("p800-8"), "node-a", HealthPolicy(), 3600, quarantine_file=quarantine)
    exporter.start()
    exporter.stop()
    got = samples(scrape_registry(exporter))
    assert [got[("kunlun_xpu_quarantined", card(i))] for i in range(8)] == [0.0] * 8  # no file yet
    assert not [k for k in got if k[0].startswith("kunlun_xpu_fault_")]  # unknown: left out, not 0
    state = FaultState(
        quarantined=frozenset({uuid(5), "GPU-of-another-node"}),
        node_read=False,  # holding the last-known quarantine: the API has not answered since the start
        api_errors={"get_node": 4, "patch_pod_status": 2},
        pods_unwritten=1,
    )
    write_state_file(quarantine, dump_state(state))
    exporter.refresh()
    got = samples(scrape_registry(exporter))
    assert [got[("kunlun_xpu_quarantined", card(i))] for i in range(8)] == [0, 0, 0, 0, 0, 1, 0, 0]
    node = (("node", "node-a"),)
    assert {k: v for k, v in got.items() if k[0].startswith("kunlun_xpu_fault_")} == {
        ("kunlun_xpu_fault_api_errors_total", (("call", "create_event"), *node)): 0.0,
        ("kunlun_xpu_fault_api_errors_total", (("call", "get_node"), *node)): 4.0,
        ("kunlun_xpu_fault_api_errors_total", (("call", "patch_node"), *node)): 0.0,
        ("kunlun_xpu_fault_api_errors_total", (("call", "patch_pod_status"), *node)): 2.0,
        ("kunlun_xpu_fault_pods_unwritten", node): 1.0,
        ("kunlun_xpu_fault_node_read", node): 0.0,
    }


def scrape_registry(exporter: Exporter) -> str:
    from prometheus_client import generate_latest

    return generate_latest(exporter.registry).decode()


def test_unreachable_pod_resources_means_no_attribution(tmp_path: Path) -> None:
    exporter = Exporter(make_source("p800-8"), "node-a", HealthPolicy(), 3600, str(tmp_path / "none.sock"))
    exporter.start()
    exporter.stop()
    assert exporter.pod_resources is not None and exporter.pod_resources.errors_total == 1
    assert samples(scrape_registry(exporter))[("kunlun_xpu_healthy", card(4))] == 1.0


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (make tools fetches it)")
def test_promtool_accepts_the_exposition(tmp_path: Path) -> None:
    exporter = Exporter(make_source("p800-failing"), "node-a", HealthPolicy(), 3600)
    exporter.start()
    exporter.stop()
    done = subprocess.run(
        ["promtool", "check", "metrics"],
        input=scrape_registry(exporter),
        capture_output=True,
        text=True,
        check=False,
    )
    assert (done.returncode, done.stdout + done.stderr) == (0, "")

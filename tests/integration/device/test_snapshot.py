"""The plugin writes the node snapshot; the labeler and the exporter read the hardware through it.

The snapshot is produced by the real `PluginServer` on fixture hosts (registered with the fake
kubelet), and the labels and metrics served from it are compared with the same components run on
`xpu-smi` directly. A stale, missing or corrupt snapshot: the labeler keeps the labels, the exporter
leaves the readings out and reports the snapshot's age.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import kubernetes
import pytest
from prometheus_client import generate_latest

from kunlun_device.cli import main
from kunlun_device.exporter import Exporter
from kunlun_device.labeler import NodeLabeler
from kunlun_device.plugin import PluginServer
from kunlun_device.xpu import SnapshotSource, XpuReader
from kunlun_device.xpu.health import HealthPolicy
from kunlun_device.xpu.health_tracker import HealthState
from kunlun_device.xpu.snapshot import parse_snapshot
from tests.integration.device.fake_kubelet import FakeKubelet, short_tempdir
from tests.integration.device.test_cli import free_port, spawn
from tests.integration.device.test_exporter import card, samples
from tests.integration.device.test_labeler import FOREIGN, P800_LABELS, node_labels
from tests.support.kubeapi import RunningKubeAPI, running_fake_api
from tests.support.waiting import wait_for
from tests.unit.device.hosts import FIXTURES, make_source

HOSTS = ["p800-8", "p800-failing", "p800-no-topo", "no-card"]
AGE = "kunlun_xpu_snapshot_age_seconds"


@pytest.fixture
def kube(tmp_path: Path) -> Iterator[RunningKubeAPI]:
    with running_fake_api(tmp_path) as api:
        kubernetes.client.CoreV1Api(api.client()).create_node({"metadata": {"name": "n1", "labels": FOREIGN}})
        yield api


def failed_rounds(labeler: NodeLabeler) -> list[float]:
    """The waits of a labeler run stopped after two waits."""
    waits: list[float] = []
    labeler.run(threading.Event(), 300, wait=lambda s: waits.append(s) or len(waits) == 2)
    return waits


def plugin_snapshot(host: str, path: Path, base: Path = FIXTURES) -> Path:
    """Run the plugin on fixture host `host` until it has written its start-up snapshot to `path`."""
    with short_tempdir() as kubelet_dir:
        kubelet = FakeKubelet(kubelet_dir)
        kubelet.start()
        plugin = PluginServer(
            make_source(host, base), kubelet_dir, health_interval_seconds=3600, snapshot_file=path
        )
        plugin.start()
        plugin.stop()
        kubelet.stop()
    return path


class Clock:
    """Unix time under the test's control, starting when the snapshot at `path` was written."""

    def __init__(self, path: Path) -> None:
        self.now = parse_snapshot(path.read_text(), str(path)).written_at

    def __call__(self) -> float:
        return self.now


def scrape(source: XpuReader) -> str:
    exporter = Exporter(source, "node-a", HealthPolicy(), 3600)
    exporter.start()
    exporter.stop()
    return generate_latest(exporter.registry).decode()


def test_plugin_writes_what_it_read_and_published(tmp_path: Path) -> None:
    before = time.time()
    snapshot = parse_snapshot(
        plugin_snapshot("p800-failing", tmp_path / "node.json").read_text(), "node.json"
    )
    direct = make_source("p800-failing")
    assert before <= snapshot.written_at <= time.time()
    assert snapshot.interval_seconds == 3600
    assert snapshot.devices == direct.list_devices()
    assert snapshot.table == direct.telemetry()
    assert (snapshot.tool_error, snapshot.kml_version, snapshot.kml_error) == (None, "3.2.0", None)
    assert snapshot.device_nodes_present == {0, 1, 2, 3, 4, 5, 7}  # /dev/xpu6 is gone
    assert {i: h.state for i, h in snapshot.health.items()} == {
        i: HealthState.UNHEALTHY if i in (5, 6) else HealthState.HEALTHY for i in range(8)
    }
    assert {i: [str(f.check) for f in h.findings] for i, h in snapshot.health.items() if h.findings} == {
        2: ["temperature-high"],
        5: ["ecc-uncorrectable"],
        6: ["device-node-missing"],
    }
    assert [p.name for p in tmp_path.iterdir()] == ["node.json"]


def test_plugin_rewrites_the_snapshot_every_round(tmp_path: Path) -> None:
    path = tmp_path / "node.json"
    with short_tempdir() as kubelet_dir:
        kubelet = FakeKubelet(kubelet_dir)
        kubelet.start()
        plugin = PluginServer(
            make_source("p800-8"), kubelet_dir, health_interval_seconds=0.05, snapshot_file=path
        )
        plugin.start()
        try:
            first = parse_snapshot(path.read_text(), "first").written_at
            deadline = time.monotonic() + 20
            while parse_snapshot(path.read_text(), "later").written_at == first:
                assert time.monotonic() < deadline, "the plugin wrote no second snapshot"
                time.sleep(0.05)
        finally:
            plugin.stop()
            kubelet.stop()


@pytest.mark.parametrize("host", HOSTS)
def test_labels_from_the_snapshot_equal_labels_from_xpu_smi(
    kube: RunningKubeAPI, tmp_path: Path, host: str
) -> None:
    api = kubernetes.client.CoreV1Api(kube.client())
    path = plugin_snapshot(host, tmp_path / "node.json")
    direct = NodeLabeler(api, "n1", make_source(host)).desired()
    assert NodeLabeler(api, "n1", SnapshotSource(path)).desired() == direct
    NodeLabeler(api, "n1", SnapshotSource(path)).apply()
    assert node_labels(kube) == FOREIGN | {k: v for k, v in direct.items() if v is not None}


@pytest.mark.parametrize("host", HOSTS)
def test_metrics_from_the_snapshot_equal_metrics_from_xpu_smi(tmp_path: Path, host: str) -> None:
    path = plugin_snapshot(host, tmp_path / "node.json")
    clock = Clock(path)
    clock.now += 2.5
    lines = scrape(SnapshotSource(path, clock=clock)).splitlines()
    assert [line for line in lines if line.startswith(AGE)] == [f'{AGE}{{node="node-a"}} 2.5']
    assert "\n".join(line for line in lines if AGE not in line) == scrape(make_source(host)).rstrip("\n")


def test_labeler_keeps_its_labels_while_the_snapshot_is_stale_missing_or_corrupt(
    kube: RunningKubeAPI, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    api = kubernetes.client.CoreV1Api(kube.client())
    path = plugin_snapshot("p800-8", tmp_path / "node.json")
    clock = Clock(path)
    labeler = NodeLabeler(api, "n1", SnapshotSource(path, max_age_seconds=60, clock=clock))
    assert labeler.apply() == P800_LABELS
    clock.now += 61  # the plugin stopped writing
    for damage in (lambda: None, lambda: path.write_text('{"format": 1, "written_at": '), path.unlink):
        damage()
        assert failed_rounds(labeler) == [1, 2]  # failed rounds, retried with backoff
        assert node_labels(kube) == FOREIGN | P800_LABELS
    failures = [r.getMessage() for r in caplog.records if "labelling failed" in r.getMessage()]
    assert len(failures) == 6
    assert all(f"node snapshot {path}: stale: written 61s ago, more than 60s" in m for m in failures[:2])
    assert all(f"node snapshot {path}: unreadable (" in m for m in failures[2:4])
    assert all(f"node snapshot {path}: missing (is the device plugin writing it?)" in m for m in failures[4:])


def test_exporter_leaves_readings_out_and_reports_the_age_of_an_unusable_snapshot(tmp_path: Path) -> None:
    path = plugin_snapshot("p800-8", tmp_path / "node.json")
    clock = Clock(path)
    exporter = Exporter(SnapshotSource(path, max_age_seconds=60, clock=clock), "node-a", HealthPolicy(), 3600)
    exporter.start()
    exporter.stop()
    fresh = samples(generate_latest(exporter.registry).decode())
    assert fresh[("kunlun_xpu_temperature_celsius", card(0))] == 38.0
    assert fresh[(AGE, (("node", "node-a"),))] == 0.0
    readings = {"kunlun_xpu_utilization_ratio", "kunlun_xpu_temperature_celsius", "kunlun_xpu_power_watts"}
    readings |= {
        "kunlun_xpu_memory_used_bytes",
        "kunlun_xpu_memory_total_bytes",
        "kunlun_xpu_ecc_errors_total",
    }
    clock.now += 90
    for errors, damage in enumerate((lambda: None, lambda: path.write_text("{"), path.unlink), start=1):
        damage()
        exporter.refresh()
        got = samples(generate_latest(exporter.registry).decode())
        assert not [k for k in got if k[0] in readings]  # never stale values
        assert got[("kunlun_xpu_tool_errors_total", (("node", "node-a"),))] == errors
        assert got[(AGE, (("node", "node-a"),))] == 90.0  # of the last snapshot parsed
        assert [got[("kunlun_xpu_healthy", card(i))] for i in range(8)] == [1.0] * 8
        findings = {k[1] for k in got if k[0] == "kunlun_xpu_health_finding"}
        assert {dict(f)["check"] for f in findings} == {"tool-error"} and len(findings) == 8
    path.write_text(json.dumps(json.loads(plugin_snapshot("p800-8", tmp_path / "again.json").read_text())))
    clock.now = time.time()
    exporter.refresh()
    back = samples(generate_latest(exporter.registry).decode())
    assert back[("kunlun_xpu_temperature_celsius", card(0))] == 38.0


def test_labeler_cli_reads_the_snapshot(kube: RunningKubeAPI, tmp_path: Path) -> None:
    path = tmp_path / "node.json"
    argv = ["labeler", "--once", "--kubeconfig", str(kube.kubeconfig), "--node-name", "n1"]
    assert main([*argv, "--source", f"snapshot:{path}"]) == 1  # no snapshot yet: no label written
    assert node_labels(kube) == FOREIGN
    plugin_snapshot("p800-8", path)
    assert main([*argv, "--source", f"snapshot:{path}"]) == 0
    assert node_labels(kube) == FOREIGN | P800_LABELS


@pytest.mark.parametrize("source", ["snapshot:", "file:/run/node.json", "xpu_smi"])
def test_a_bad_source_exits_2_naming_the_flag(source: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["exporter", "--source", source]) == 2
    assert capsys.readouterr().err.startswith(
        f"kunlun-device-plugin exporter: --source: expected xpu-smi or snapshot:PATH, got {source!r}"
    )


def test_exporter_process_waits_for_the_snapshot_then_serves_it(tmp_path: Path) -> None:
    path, port = tmp_path / "node.json", free_port()
    process = spawn(
        "exporter", "--source", f"snapshot:{path}", "--node-name", "node-a", "--listen-address", "127.0.0.1",
        "--port", str(port), "--pod-resources-socket", "",
    )  # fmt: skip
    assert process.stdout is not None
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(process.stdout or ()), daemon=True)
    reader.start()
    try:
        wait_for(
            lambda: any("waiting for the device plugin's node snapshot" in line for line in output),
            timeout_seconds=30,
            message="the exporter to wait for the snapshot",
        )
        plugin_snapshot("p800-8", path)
        body = wait_for(
            lambda: scrape_port(port),
            timeout_seconds=30,
            message="/metrics from the snapshot",
            ignoring=(OSError,),
        )
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=30)
        reader.join(timeout=10)
    assert code == 0, "".join(output)
    got = samples(body)
    assert [got[("kunlun_xpu_healthy", card(i))] for i in range(8)] == [1.0] * 8
    assert (AGE, (("node", "node-a"),)) in got


def scrape_port(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())

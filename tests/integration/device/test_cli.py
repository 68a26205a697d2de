"""`kunlun-device-plugin` as a process: flags, start-up against fixture hosts, clean stop on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kunlun_device.cli import main
from tests.integration.device.fake_kubelet import FakeKubelet, short_tempdir
from tests.support.waiting import wait_for
from tests.unit.device.hosts import FIXTURES

P800 = FIXTURES / "p800-8"
COMMON = ["--xpu-smi", str(P800 / "xpu-smi"), "--dev-root", str(P800 / "root")]


def spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kunlun_device.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def stop(process: subprocess.Popen[str]) -> tuple[int, str]:
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=30)
    return process.returncode, output


def test_plugin_process_registers_and_stops_cleanly() -> None:
    with short_tempdir() as kubelet_dir:
        kubelet = FakeKubelet(kubelet_dir)
        kubelet.start()
        process = spawn("plugin", *COMMON, "--kubelet-dir", str(kubelet_dir), "--health-interval", "0.2")
        try:
            request = kubelet.next_registration(timeout_seconds=30)
        finally:
            code, output = stop(process)
            kubelet.stop()
        assert (request.resource_name, request.endpoint) == ("kunlunxin.com/xpu", "kunlun-xpu.sock")
        assert code == 0, output
        assert "registered kunlunxin.com/xpu with kubelet" in output
        assert not (kubelet_dir / "kunlun-xpu.sock").exists()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_exporter_process_serves_metrics() -> None:
    port = free_port()
    process = spawn(
        "exporter", *COMMON, "--node-name", "node-a", "--listen-address", "127.0.0.1", "--port", str(port),
        "--pod-resources-socket", "",
    )  # fmt: skip
    body: list[str] = []

    def scraped() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                body.append(response.read().decode())
        except OSError:
            return process.poll() is not None  # stop polling if the process died
        return True

    try:
        wait_for(scraped, timeout_seconds=30, message="the exporter to serve /metrics (or to exit)")
    finally:
        code, output = stop(process)
    assert code == 0, output
    families = {f.name: f for f in text_string_to_metric_families(body[0])}
    healthy = [s for s in families["kunlun_xpu_healthy"].samples]
    assert [(s.labels["device"], s.labels["node"], s.value) for s in healthy] == [
        (f"xpu{i}", "node-a", 1.0) for i in range(8)
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["plugin", "--health-policy", "ecc=warn"],
            "kunlun-device-plugin plugin: --health-policy: unknown check",
        ),
        (["labeler", "--once", "--node-name", ""], "kunlun-device-plugin labeler: --node-name: required"),
        (["dra", "--node-name", ""], "kunlun-device-plugin dra: --node-name: required"),
        (
            ["plugin", "--respond-to-faults", "--node-name", ""],
            "kunlun-device-plugin plugin: --node-name: required with --respond-to-faults",
        ),
        (
            ["plugin", "--respond-to-faults", "--node-name", "n1", "--quarantine-failures", "0"],
            "kunlun-device-plugin plugin: --quarantine-failures: must be >= 1",
        ),
        (
            ["exporter", "--temperature-warn-celsius", "99"],
            "kunlun-device-plugin exporter: --temperature-warn-celsius: must not exceed",
        ),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*argv, *COMMON]) == 2
    assert capsys.readouterr().err.startswith(message)


def test_argparse_rejects_non_positive_interval(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["plugin", "--health-interval", "0"])
    assert caught.value.code == 2
    assert "argument --health-interval: must be > 0: '0'" in capsys.readouterr().err


def test_missing_tool_exits_1(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    argv = ["plugin", "--xpu-smi", str(tmp_path / "xpu-smi"), "--kubelet-dir", str(tmp_path)]
    assert main(argv) == 1
    assert f"plugin: xpu-smi not found or not executable: '{tmp_path / 'xpu-smi'}'" in caplog.text


def run_without_cluster(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The command as a process outside any cluster: no service account, no $KUBECONFIG, an empty
    home (no ~/.kube/config)."""
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    env["HOME"] = str(tmp_path)
    return subprocess.run(
        [sys.executable, "-m", "kunlun_device.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    "command", [["dra", "--node-name", "n1"], ["labeler", "--once", "--node-name", "n1"]]
)
def test_no_api_configuration_exits_1_naming_what_is_missing(tmp_path: Path, command: list[str]) -> None:
    missing = tmp_path / "missing.kubeconfig"
    given = run_without_cluster(tmp_path, *command, "--kubeconfig", str(missing), *COMMON)
    assert (given.returncode, "Traceback" in given.stderr) == (1, False)
    assert f"{command[0]}: no Kubernetes API access: --kubeconfig {missing}: no such file" in given.stderr
    default = run_without_cluster(tmp_path, *command, *COMMON)
    assert (default.returncode, "Traceback" in default.stderr) == (1, False)
    assert (
        f"{command[0]}: no Kubernetes API access: not running in a cluster (Service host/port is not set.) "
        "and no usable kubeconfig at ~/.kube/config: Invalid kube-config file. No configuration found.; "
        "pass --kubeconfig PATH"
    ) in default.stderr

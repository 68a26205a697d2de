"""`XpuSource` against whole fixture hosts: discovery, versions, KML source, tool failures."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kunlun_device.errors import XpuError, XpuParseError, XpuToolFailedError, XpuToolMissingError
from kunlun_device.xpu import Versions, XpuDevice, XpuSource
from tests.unit.device.hosts import FIXTURES, copy_host, make_source

GIB = 1024**3


def test_discovers_eight_p800_cards_with_numa_from_sysfs() -> None:
    devices = make_source("p800-8").list_devices()
    assert len(devices) == 8
    assert devices[6] == XpuDevice(
        index=6,
        uuid="GPU-7c1f0006-5a2b-5c3d-8e4f-012345678906",
        product="P800 OAM",
        memory_total_bytes=96 * GIB,
        bus_id="00000000:AA:00.0",
        numa_node=1,
        device_path="/dev/xpu6",
        firmware_version="1.0.2.14.1.54",
    )
    assert [d.numa_node for d in devices] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_numa_falls_back_to_topology_without_sysfs(tmp_path: Path) -> None:
    host = copy_host("p800-8", tmp_path)
    for numa in (host / "root" / "sys").rglob("numa_node"):
        numa.write_text("-1\n")
    devices = make_source("p800-8", tmp_path).list_devices()
    assert [d.numa_node for d in devices] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_versions_of_healthy_node() -> None:
    assert make_source("p800-8").versions() == Versions(
        driver="5.0.21.26", runtime="5.0.21", firmware="1.0.2.14.1.54", kml="3.2.0"
    )


def test_kml_version_from_runtime_json_report(tmp_path: Path) -> None:
    host = copy_host("p800-8", tmp_path)
    (host / "root/usr/local/xpu/kml/VERSION").write_text('{"kml_version": "3.2.1", "reported_by": "runtime"}')
    assert make_source("p800-8", tmp_path).kml_version() == "3.2.1"


def test_kml_version_garbage_is_an_error_quoting_it(tmp_path: Path) -> None:
    host = copy_host("p800-8", tmp_path)
    (host / "root/usr/local/xpu/kml/VERSION").write_text("version: ???\n")
    with pytest.raises(XpuParseError, match="not a version string") as caught:
        make_source("p800-8", tmp_path).kml_version()
    assert caught.value.line == "version: ???"


@pytest.mark.parametrize("spoil", ["directory", "binary"])
def test_an_unreadable_kml_file_is_an_xpu_error_naming_it(tmp_path: Path, spoil: str) -> None:
    # A plain OSError or UnicodeDecodeError would escape the plugin's health loop and end it.
    version_file = copy_host("p800-8", tmp_path) / "root/usr/local/xpu/kml/VERSION"
    version_file.unlink()
    if spoil == "directory":
        version_file.mkdir()
    else:
        version_file.write_bytes(b"\xff\xfe\x00garbled")
    with pytest.raises(XpuError, match="/usr/local/xpu/kml/VERSION: cannot be read"):
        make_source("p800-8", tmp_path).kml_version()


def test_kml_source_disabled_or_absent_is_none() -> None:
    host = FIXTURES / "p800-8"
    assert XpuSource(str(host / "xpu-smi"), host / "root", kml_version_file=None).kml_version() is None
    assert XpuSource(str(host / "xpu-smi"), host / "root", kml_version_file="/nope").kml_version() is None


def test_no_card_node_has_no_devices_and_no_versions() -> None:
    source = make_source("no-card")
    assert source.list_devices() == ()
    assert source.versions() == Versions(driver=None, runtime=None, firmware=None, kml=None)


def test_missing_tool_is_a_clear_error() -> None:
    path = str(FIXTURES / "missing-tool" / "xpu-smi")
    with pytest.raises(XpuToolMissingError, match="xpu-smi not found or not executable"):
        make_source("missing-tool").list_devices()
    with pytest.raises(XpuToolMissingError) as caught:
        make_source("missing-tool").telemetry()
    assert caught.value.command == path


def test_garbage_discovery_quotes_the_line() -> None:
    with pytest.raises(XpuParseError) as caught:
        make_source("garbage").telemetry()
    assert caught.value.source == "xpu-smi"
    assert "lots of MiB" in caught.value.line


def test_tool_exit_status_is_reported(tmp_path: Path) -> None:
    host = copy_host("p800-8", tmp_path)
    (host / "outputs" / "table.exit").write_text("9\n")
    with pytest.raises(XpuToolFailedError, match="exit status 9") as caught:
        make_source("p800-8", tmp_path).telemetry()
    assert caught.value.argv == [str(host / "xpu-smi")]


def test_device_nodes_under_root() -> None:
    source = make_source("p800-failing")
    assert [source.device_node_present(i) for i in range(8)] == [True] * 6 + [False, True]
    assert source.control_node_present()
    assert not make_source("no-card").control_node_present()


@pytest.mark.parametrize(
    ("host", "why"),
    [
        ("p800-no-topo", "topo -m: exit status 1: xpu-smi: unknown command 'topo'"),
        ("p800-topo-pairs", "xpu-smi topo -m: link cells do not match the header at line 4"),
    ],
)
def test_unusable_topology_without_sysfs_numa_is_unknown_numa_warned_once(
    host: str, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    source = make_source(host)
    caplog.set_level(logging.WARNING, logger="kunlun_device.xpu.source")
    first, again = source.list_devices(), source.list_devices()  # e.g. two labeler rounds
    assert first == again
    assert [(d.index, d.numa_node, d.device_path) for d in first] == [
        (i, None, f"/dev/xpu{i}") for i in range(8)
    ]
    (record,) = caplog.records
    message = record.getMessage()
    assert message.startswith(
        "NUMA node unknown for xpu0, xpu1, xpu2, xpu3, xpu4, xpu5, xpu6, xpu7 (sysfs has no numa_node for "
        "them and the topology is unusable: "
    )
    assert why in message
    assert message.endswith("; they are advertised to kubelet without NUMA topology")


def test_probe_topology_is_none_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    source = make_source("p800-no-topo")
    caplog.set_level(logging.WARNING, logger="kunlun_device.xpu.source")
    assert (source.probe_topology(), source.probe_topology()) == (None, None)
    assert [r.getMessage() for r in caplog.records] == [
        "no card topology, allocating without XPU Link preference: "
        f"{FIXTURES / 'p800-no-topo' / 'xpu-smi'} topo -m: exit status 1: xpu-smi: unknown command 'topo'"
    ]
    with pytest.raises(XpuToolFailedError, match="unknown command 'topo'"):
        source.topology()  # the strict reader still raises

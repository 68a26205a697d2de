"""`resolve_numa`: sysfs first, then the topology; a missing or unreadable topology means unknown."""

from __future__ import annotations

import pytest

from kunlun_device.errors import XpuError, XpuToolFailedError
from kunlun_device.xpu import Topology, parse_smi_topo
from kunlun_device.xpu.numa import NumaProbe, resolve_numa
from tests.unit.device.hosts import FIXTURES

NO_SYSFS = dict.fromkeys(range(4))


def read_topo(host: str) -> str:
    return (FIXTURES / host / "outputs" / "topo.txt").read_text()


def fails(error: XpuError) -> Topology:
    raise error


def not_called() -> Topology:
    raise AssertionError("the topology must not be read when sysfs knows every card")


def test_sysfs_alone_does_not_read_the_topology() -> None:
    assert resolve_numa({0: 0, 1: 1}, not_called) == NumaProbe({0: 0, 1: 1}, None)


def test_topology_fills_what_sysfs_lacks() -> None:
    topology = parse_smi_topo(read_topo("p800-8"))
    assert resolve_numa({0: 0, 5: None}, lambda: topology) == NumaProbe({0: 0, 5: 1}, None)


def test_missing_topo_command_means_unknown_numa_not_an_error() -> None:
    error = XpuToolFailedError(["xpu-smi", "topo", "-m"], "exit status 1: xpu-smi: unknown command 'topo'")
    probe = resolve_numa(NO_SYSFS | {2: 0}, lambda: fails(error))
    assert probe == NumaProbe(
        {0: None, 1: None, 2: 0, 3: None},
        "sysfs has no numa_node for them and the topology is unusable: "
        "xpu-smi topo -m: exit status 1: xpu-smi: unknown command 'topo'",
    )
    assert probe.unknown_ids == (0, 1, 3)


def test_other_topology_layout_means_unknown_numa_not_an_error() -> None:
    probe = resolve_numa(NO_SYSFS, lambda: parse_smi_topo(read_topo("p800-topo-pairs")))
    assert probe.numa_nodes == NO_SYSFS
    assert probe.unknown_reason == (
        "sysfs has no numa_node for them and the topology is unusable: xpu-smi topo -m: link cells do "
        "not match the header at line 4: 'XPU0 (NUMA 0) <-> XPU2 (NUMA 0) : XPU Link x1'"
    )


@pytest.mark.parametrize(
    "text",
    [
        "        XPU0 XPU1 CPU Affinity\nXPU0    X    XL   0-51\nXPU1    XL   X    0-51\n",
        "        XPU0 XPU1 CPU Affinity    NUMA Affinity\nXPU0    X    XL   0-51  N/A\nXPU1    XL   X    0-51  N/A\n",
    ],
    ids=["no-numa-column", "numa-not-available"],
)
def test_topology_without_numa_affinity_means_unknown(text: str) -> None:
    probe = resolve_numa({0: None, 1: None}, lambda: parse_smi_topo(text))
    assert probe == NumaProbe(
        {0: None, 1: None},
        "sysfs has no numa_node for them and xpu-smi topo -m reports no NUMA Affinity for them",
    )

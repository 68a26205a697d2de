"""Parsers of xpu-smi outputs against the fixture hosts."""

from __future__ import annotations

import pytest

from kunlun_device.errors import XpuParseError
from kunlun_device.xpu import (
    CardDetail,
    CardTelemetry,
    ListedCard,
    parse_smi_list,
    parse_smi_query,
    parse_smi_table,
    parse_smi_topo,
)
from tests.unit.device.hosts import FIXTURES

GIB = 1024**3


def read(host: str, name: str) -> str:
    return (FIXTURES / host / "outputs" / name).read_text()


def test_table_of_healthy_node_has_versions_and_eight_cards() -> None:
    table = parse_smi_table(read("p800-8", "table.txt"))
    assert (table.driver_version, table.runtime_version) == ("5.0.21.26", "5.0.21")
    assert [card.index for card in table.cards] == list(range(8))
    assert table.cards[4] == CardTelemetry(
        index=4,
        product="P800 OAM",
        bus_id="00000000:9A:00.0",
        temperature_celsius=49.0,
        power_watts=89.0,
        power_limit_watts=400.0,
        memory_used_bytes=60 * GIB,
        memory_total_bytes=96 * GIB,
        utilization_ratio=0.87,
        ecc_uncorrectable_errors=0,
    )


def test_table_of_failing_node_reports_ecc_and_temperature() -> None:
    cards = parse_smi_table(read("p800-failing", "table.txt")).cards
    assert [
        (c.index, c.ecc_uncorrectable_errors, c.temperature_celsius) for c in cards if c.index in (2, 5)
    ] == [
        (2, 0, 88.0),
        (5, 3, 41.0),
    ]


def test_table_na_readings_become_none_not_zero() -> None:
    text = read("p800-8", "table.txt").replace("38C  N/A     85W / 400W", " N/A  N/A     N/A / 400W", 1)
    text = text.replace("|                    0 |", "|                  N/A |", 1)
    card = parse_smi_table(text).cards[0]
    assert (card.temperature_celsius, card.power_watts, card.ecc_uncorrectable_errors) == (None, None, None)


def test_table_no_devices_is_empty() -> None:
    table = parse_smi_table(read("no-card", "table.txt"))
    assert (table.driver_version, table.runtime_version, table.cards) == ("", "", ())


def test_table_garbage_quotes_the_offending_line() -> None:
    with pytest.raises(XpuParseError) as caught:
        parse_smi_table(read("garbage", "table.txt"))
    line = "| N/A   49C  N/A     89W / 400W |  lots of MiB / 96GiB |     87%      Default |"
    assert (caught.value.line_number, caught.value.line) == (26, line)
    assert repr(line) in str(caught.value)
    assert "unexpected cell 'lots of MiB / 96GiB'" in str(caught.value)


@pytest.mark.parametrize(
    ("text", "number", "reason"),
    [
        ("hello\nworld\n", 1, "no 'Driver Version' header"),
        (
            "| XPU-SMI  Driver Version: 5.0.21.26    XPU-RT Version: 5.0.21 |\n",
            1,
            "no card table after header",
        ),
    ],
)
def test_table_without_structure_names_the_problem(text: str, number: int, reason: str) -> None:
    with pytest.raises(XpuParseError, match=reason) as caught:
        parse_smi_table(text)
    assert caught.value.line_number == number


def test_table_truncated_card_block_is_an_error() -> None:
    lines = read("p800-8", "table.txt").splitlines()
    with pytest.raises(XpuParseError, match="card block cut short") as caught:
        parse_smi_table("\n".join(lines[:10]) + "\n")
    assert caught.value.line_number == 10


def test_query_detail_of_one_card() -> None:
    detail = parse_smi_query(read("p800-failing", "query-5.txt"), "xpu-smi -q --id=5")
    assert detail == CardDetail(
        index=5,
        uuid="GPU-7c1f0005-5a2b-5c3d-8e4f-012345678905",
        product="P800 OAM",
        bus_id="00000000:9B:00.0",
        firmware_version="1.0.2.14.1.54",
        memory_total_bytes=96 * GIB,
        ecc_correctable_errors=0,
        ecc_uncorrectable_errors=3,
    )


def test_query_missing_uuid_names_the_field() -> None:
    text = "\n".join(line for line in read("p800-8", "query-0.txt").splitlines() if "UUID" not in line)
    with pytest.raises(XpuParseError, match="missing field 'XPU UUID'"):
        parse_smi_query(text)


def test_query_malformed_minor_number_quotes_line() -> None:
    text = read("p800-8", "query-0.txt").replace(
        "Minor Number                          : 0", "Minor Number : zero"
    )
    with pytest.raises(XpuParseError) as caught:
        parse_smi_query(text, "xpu-smi -q --id=0")
    assert caught.value.line == "    Minor Number : zero"
    assert str(caught.value) == (
        "xpu-smi -q --id=0: Minor Number is not a whole number at line 14: '    Minor Number : zero'"
    )


def test_list_of_cards() -> None:
    cards = parse_smi_list(read("p800-8", "list.txt"))
    assert cards[7] == ListedCard(7, "P800 OAM", "GPU-7c1f0007-5a2b-5c3d-8e4f-012345678907")
    assert len(cards) == 8
    wrapped = parse_smi_list("XPU 0: P800 PCIe (UUID: GPU-420716f2-9928-5108-a5b2-e6b7cf36b37c)\n")
    assert wrapped == (ListedCard(0, "P800 PCIe", "GPU-420716f2-9928-5108-a5b2-e6b7cf36b37c"),)


def test_list_garbage_quotes_line() -> None:
    with pytest.raises(XpuParseError) as caught:
        parse_smi_list(read("garbage", "list.txt"))
    assert (caught.value.line_number, caught.value.line) == (
        4,
        "XPU three P800 OAM  GPU-7c1f0003-5a2b-5c3d-8e4f-012345678903",
    )


def test_topology_links_and_numa() -> None:
    topology = parse_smi_topo(read("p800-8", "topo.txt"))
    assert topology.numa_nodes == {0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 1, 7: 1}
    linked = sorted(pair for pair, kind in topology.links.items() if kind == "XL" and pair[0] < pair[1])
    halves = [(a, b) for h in (0, 4) for a in range(h, h + 4) for b in range(a + 1, h + 4)]
    assert linked == sorted([*halves, (0, 4), (1, 5), (2, 6), (3, 7)])
    assert topology.links[(0, 5)] == "SYS"
    assert topology.linked(1, 5) and not topology.linked(1, 6)


def test_topology_asymmetric_cell_is_not_trusted() -> None:
    text = "        XPU0 XPU1\nXPU0    X    XL\nXPU1    SYS  X\n"
    assert parse_smi_topo(text).links == {(0, 1): "SYS", (1, 0): "SYS"}


def test_topology_garbage_quotes_first_line() -> None:
    with pytest.raises(XpuParseError, match=r"no 'XPU0 XPU1 \.\.\.' header") as caught:
        parse_smi_topo(read("garbage", "topo.txt"))
    assert caught.value.line == "topology unavailable: xpulink driver not loaded"


def test_topology_bad_cell_quotes_row() -> None:
    text = "        XPU0 XPU1\nXPU0    X    XL\nXPU1    ??   X\n"
    with pytest.raises(XpuParseError, match="link cells do not match") as caught:
        parse_smi_topo(text)
    assert caught.value.line == "XPU1    ??   X"

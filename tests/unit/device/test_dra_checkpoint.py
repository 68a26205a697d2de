"""The DRA checkpoint: what it writes it reads back; anything else is an error naming the field."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kunlun_device.dra.checkpoint import (
    PreparedClaim,
    PreparedDevice,
    dump_checkpoint,
    load_checkpoint,
    parse_checkpoint,
    save_checkpoint,
)
from kunlun_device.errors import CheckpointError

CLAIMS = {
    "u1": PreparedClaim(
        "u1", "ml", "tp2", (PreparedDevice(("tp",), "node-a", "xpu-4", 4, ("kunlun.dev/xpu=u1-xpu-4",)),)
    )
}


def test_round_trip_and_absent_file(tmp_path: Path) -> None:
    path = tmp_path / "dra" / "checkpoint.json"
    assert load_checkpoint(path) == {}
    save_checkpoint(path, CLAIMS)
    assert load_checkpoint(path) == CLAIMS
    assert sorted(p.name for p in path.parent.iterdir()) == ["checkpoint.json"]  # nothing left aside


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda t: t.replace('"index": 4', '"index": "4"'),
            "claims.u1.devices[0].index is '4', expected int",
        ),
        (lambda t: t.replace('"poolName"', '"pool"'), "missing field 'poolName'"),
        (lambda t: t.replace('"format": 1', '"format": 2'), "not a format 1 checkpoint"),
        (
            lambda t: t.replace('"claims": {', '"claims": {"u0": "tp2", ', 1),
            "claims.u0 is 'tp2', expected an object",
        ),
        (lambda t: t[:10], "Unterminated string"),
    ],
)
def test_corrupt_checkpoints_name_the_field(change: Callable[[str], str], message: str) -> None:
    text = change(dump_checkpoint(CLAIMS))
    with pytest.raises(CheckpointError) as caught:
        parse_checkpoint(text, "f.json")
    assert str(caught.value).startswith("DRA checkpoint f.json: ")
    assert message in str(caught.value)

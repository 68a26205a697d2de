"""The DRA plugin's checkpoint: which claims it prepared, so that a restart neither loses one (its
unprepare still removes the CDI spec) nor prepares one twice (a repeated prepare answers from here).

Format (`FORMAT` 1): a JSON object ``{"format": 1, "claims": {uid: {namespace, name, devices}}}``,
each device ``{requestNames, poolName, deviceName, index, cdiDeviceIds}``.

Invariant: the file is replaced atomically (write aside, fsync, rename), so after a crash it holds
the state before or after the change, never half of it; `parse_checkpoint` accepts exactly what
`dump_checkpoint` writes and raises `CheckpointError` naming the field for anything else.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kunlun_device.errors import CheckpointError

FORMAT = 1


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    """One card of a prepared claim, as kubelet was told."""

    request_names: tuple[str, ...]
    pool_name: str
    device_name: str  # xpu-<index>
    index: int
    cdi_device_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class PreparedClaim:
    uid: str
    namespace: str
    name: str
    devices: tuple[PreparedDevice, ...]


def dump_checkpoint(claims: dict[str, PreparedClaim]) -> str:
    data = {
        "format": FORMAT,
        "claims": {
            uid: {
                "namespace": claim.namespace,
                "name": claim.name,
                "devices": [
                    {
                        "requestNames": list(d.request_names),
                        "poolName": d.pool_name,
                        "deviceName": d.device_name,
                        "index": d.index,
                        "cdiDeviceIds": list(d.cdi_device_ids),
                    }
                    for d in claim.devices
                ],
            }
            for uid, claim in sorted(claims.items())
        },
    }
    return json.dumps(data, indent=1)


def _strings(value: Any, field: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"{field} is not a list of strings")
    return tuple(value)


def _typed(value: Any, kind: type, field: str) -> Any:
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TypeError(f"{field} is {value!r}, expected {kind.__name__}")
    return value


def _device(item: Any, where: str) -> PreparedDevice:
    if not isinstance(item, dict):
        raise TypeError(f"{where} is not an object")
    return PreparedDevice(
        request_names=_strings(item["requestNames"], f"{where}.requestNames"),
        pool_name=_typed(item["poolName"], str, f"{where}.poolName"),
        device_name=_typed(item["deviceName"], str, f"{where}.deviceName"),
        index=_typed(item["index"], int, f"{where}.index"),
        cdi_device_ids=_strings(item["cdiDeviceIds"], f"{where}.cdiDeviceIds"),
    )


def parse_checkpoint(text: str, source: str) -> dict[str, PreparedClaim]:
    """The claims in checkpoint `text` (the contents of file `source`).

    Raises:
        CheckpointError: not JSON, another format, or a field missing or mistyped (named).
    """
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not a format {FORMAT} checkpoint")
        claims = _typed(data["claims"], dict, "claims")
        result = {}
        for uid, item in claims.items():
            where = f"claims.{uid}"
            if not isinstance(item, dict):
                raise TypeError(f"{where} is {item!r}, expected an object")
            devices = _typed(item["devices"], list, f"{where}.devices")
            result[uid] = PreparedClaim(
                uid=uid,
                namespace=_typed(item["namespace"], str, f"{where}.namespace"),
                name=_typed(item["name"], str, f"{where}.name"),
                devices=tuple(_device(d, f"{where}.devices[{i}]") for i, d in enumerate(devices)),
            )
        return result
    except (KeyError, TypeError, ValueError) as exc:
        detail = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
        raise CheckpointError(source, detail) from exc


def load_checkpoint(path: Path) -> dict[str, PreparedClaim]:
    """The prepared claims recorded at `path`; none when the file does not exist yet.

    Raises:
        CheckpointError: the file exists but cannot be read or parsed.
    """
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(str(path), f"unreadable: {exc}") from exc
    return parse_checkpoint(text, str(path))


def save_checkpoint(path: Path, claims: dict[str, PreparedClaim]) -> None:
    """Atomically replace `path` with `claims` (durable before it returns).

    Raises:
        OSError: the directory is missing or not writable.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(f".{path.name}.new")
    with staged.open("w") as handle:
        handle.write(dump_checkpoint(claims))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(staged, path)

"""Read safetensors weights from a HF-format directory: single file or sharded with an index.

Every file is checked before use: a missing shard or a truncated file is an error naming it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kunlun_runtime.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"


def list_weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of ``model_dir`` (from the index when sharded)."""
    index = model_dir / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as error:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({error})") from error
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{model_dir}: no *.safetensors weight files")
    for path in files:
        if not path.exists():
            raise ModelLoadError(f"{path}: weight file listed in {INDEX_FILE} is missing")
    return files


def iter_weights(
    model_dir: Path, wanted: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every weight (only those ``wanted`` accepts: the others are never
    read); raises ModelLoadError naming a bad file."""
    for path in list_weight_files(model_dir):
        _check_not_truncated(path)
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                    if wanted is None or wanted(name):
                        yield name, handle.get_tensor(name)
        except (SafetensorError, OSError) as error:
            raise ModelLoadError(f"{path}: cannot read safetensors file ({error})") from error


def _check_not_truncated(path: Path) -> None:
    # Header: 8-byte little-endian length, JSON with each tensor's data_offsets; the file must
    # hold every byte the header promises (safetensors would otherwise fail deep inside mmap).
    size = path.stat().st_size
    try:
        with path.open("rb") as handle:
            header_len = int.from_bytes(handle.read(8), "little")
            if header_len <= 0 or 8 + header_len > size:
                raise ValueError("header longer than file")
            header = json.loads(handle.read(header_len))
    except (ValueError, json.JSONDecodeError) as error:
        raise ModelLoadError(f"{path}: truncated or corrupt safetensors file ({error})") from error
    end = max((meta["data_offsets"][1] for key, meta in header.items() if key != "__metadata__"), default=0)
    if 8 + header_len + end > size:
        raise ModelLoadError(
            f"{path}: truncated safetensors file ({size} bytes, header promises {8 + header_len + end})"
        )

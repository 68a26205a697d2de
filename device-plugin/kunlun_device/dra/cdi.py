"""CDI (Container Device Interface) specs: how a prepared claim's cards reach its containers.

One spec file per claim, ``<cdi-dir>/kunlun.dev-xpu_<claim uid>.json``, of kind `CDI_KIND`:
- one CDI device per card, named ``<claim uid>-xpu-<index>``, whose edits add ``/dev/xpu<index>``;
- spec-wide edits, applied once whenever any device of the spec is injected: the control node
  ``/dev/xpuctrl`` (when the node has one) and ``XPU_VISIBLE_DEVICES`` = the claim's card indices,
  ascending, comma-separated — the variable the runtime and `kunlun-runtime preflight` read, as the
  classic plugin's `Allocate` sets it.
kubelet hands the container runtime the ids ``kunlun.dev/xpu=<claim uid>-xpu-<index>``. A container
using two of our claims gets the `XPU_VISIBLE_DEVICES` of one of them: ask for all cards in one
claim.

Invariant: `build_cdi_spec` is pure and names devices by claim uid, so two claims never clash; a
spec file is replaced atomically (write aside, then rename), so the runtime never reads half of one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kunlun_device.labels import CONTROL_DEVICE, VISIBLE_DEVICES_ENV
from kunlun_device.xpu.model import XpuDevice

CDI_VERSION = "0.6.0"
CDI_KIND = "kunlun.dev/xpu"
DEFAULT_CDI_DIR = "/var/run/cdi"


def cdi_device_name(claim_uid: str, index: int) -> str:
    return f"{claim_uid}-xpu-{index}"


def cdi_device_id(claim_uid: str, index: int) -> str:
    """The fully qualified CDI id kubelet passes on: ``kunlun.dev/xpu=<claim uid>-xpu-<index>``."""
    return f"{CDI_KIND}={cdi_device_name(claim_uid, index)}"


def spec_path(cdi_dir: Path, claim_uid: str) -> Path:
    return cdi_dir / f"{CDI_KIND.replace('/', '-')}_{claim_uid}.json"


def _node(path: str) -> dict[str, str]:
    return {"path": path, "hostPath": path, "permissions": "rw"}


def build_cdi_spec(claim_uid: str, cards: Sequence[XpuDevice], control_device: bool) -> dict[str, Any]:
    """The CDI spec of one claim (see the module docstring).

    Args:
        claim_uid: the ResourceClaim's uid.
        cards: the claim's cards on this node (any order; the spec lists them by index).
        control_device: whether `/dev/xpuctrl` exists on the node.
    """
    ordered = sorted(cards, key=lambda d: d.index)
    edits: dict[str, Any] = {"env": [f"{VISIBLE_DEVICES_ENV}={','.join(str(d.index) for d in ordered)}"]}
    if control_device:
        edits["deviceNodes"] = [_node(CONTROL_DEVICE)]
    return {
        "cdiVersion": CDI_VERSION,
        "kind": CDI_KIND,
        "containerEdits": edits,
        "devices": [
            {
                "name": cdi_device_name(claim_uid, d.index),
                "containerEdits": {"deviceNodes": [_node(d.device_path)]},
            }
            for d in ordered
        ],
    }


def write_cdi_spec(cdi_dir: Path, claim_uid: str, spec: dict[str, Any]) -> Path:
    """Atomically write the claim's spec file, readable by the container runtime.

    Raises:
        OSError: the directory cannot be created or written.
    """
    cdi_dir.mkdir(parents=True, exist_ok=True)
    path = spec_path(cdi_dir, claim_uid)
    staged = path.with_name(f".{path.name}.new")
    staged.write_text(json.dumps(spec, indent=1))
    staged.chmod(0o644)
    os.replace(staged, path)
    return path


def remove_cdi_spec(cdi_dir: Path, claim_uid: str) -> bool:
    """Remove the claim's spec file; False when there was none (unprepare is idempotent)."""
    path = spec_path(cdi_dir, claim_uid)
    existed = path.exists()
    path.unlink(missing_ok=True)
    return existed

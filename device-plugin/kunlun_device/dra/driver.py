"""`DraDriver`: prepare and unprepare claims — read the claim, write its CDI spec, checkpoint it.

Prepare of a claim already in the checkpoint answers what was answered before (its CDI spec is
written again if it went missing) without reading the API: a repeated call and a call after a plugin
restart both find it there, so no claim is prepared twice. Otherwise the claim is read from the API
(`ClaimReader`), its cards checked (`allocation.claim_cards`), the spec written, then the
checkpoint saved. Unprepare removes the spec, then the checkpoint entry; a claim not in the
checkpoint is already unprepared (success). A crash between the two steps leaves a state the
repeated call completes.

Invariant: one claim's failure (API error, bad allocation, unwritable file) is that claim's error
string, never an exception out of `prepare`/`unprepare`; calls are serialised by one lock, so the
checkpoint always matches the spec files written by this process.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kunlun_device.dra.allocation import ClaimRef, claim_cards
from kunlun_device.dra.cdi import build_cdi_spec, cdi_device_id, remove_cdi_spec, spec_path, write_cdi_spec
from kunlun_device.dra.checkpoint import PreparedClaim, PreparedDevice, load_checkpoint, save_checkpoint
from kunlun_device.dra.slices import device_name
from kunlun_device.errors import ClaimError
from kunlun_device.xpu.model import XpuDevice

logger = logging.getLogger(__name__)


class ClaimReader(Protocol):
    """Reads a ResourceClaim (`resource.k8s.io/v1`) as a dict; raises `ClaimError` naming the claim
    when the API cannot answer."""

    def read_claim(self, namespace: str, name: str) -> Mapping[str, Any]: ...


@dataclass(frozen=True, slots=True)
class PrepareResult:
    """What kubelet is told for one claim: its devices, or why it failed."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


class DraDriver:
    """Prepares this node's claims.

    Args:
        node_name: this node (the pool name).
        devices: the node's cards.
        claims: reads ResourceClaims from the API.
        cdi_dir: where CDI specs go (the container runtime's CDI directory).
        checkpoint_file: the checkpoint (`kunlun_device.dra.checkpoint`).
        control_device: whether `/dev/xpuctrl` exists.
        unhealthy: returns the indices of the cards unhealthy now.
    Raises:
        CheckpointError: the checkpoint exists but is unreadable (the plugin must not start and
            forget prepared claims).
    """

    def __init__(
        self,
        node_name: str,
        devices: Sequence[XpuDevice],
        claims: ClaimReader,
        cdi_dir: Path,
        checkpoint_file: Path,
        control_device: bool,
        unhealthy: Callable[[], Collection[int]],
    ) -> None:
        self.node_name = node_name
        self.devices = tuple(devices)
        self.claims = claims
        self.cdi_dir = cdi_dir
        self.checkpoint_file = checkpoint_file
        self.control_device = control_device
        self.unhealthy = unhealthy
        self._lock = threading.Lock()
        self.prepared = load_checkpoint(checkpoint_file)
        self.claim_reads = 0
        logger.info("checkpoint %s: %d prepared claims", checkpoint_file, len(self.prepared))

    def prepare(self, refs: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        """Prepare each claim; every uid of `refs` gets an entry."""
        with self._lock:
            return {ref.uid: self._prepare_one(ref) for ref in refs}

    def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, str]:
        """Unprepare each claim: uid -> error ('' on success)."""
        with self._lock:
            return {ref.uid: self._unprepare_one(ref) for ref in refs}

    def _prepare_one(self, ref: ClaimRef) -> PrepareResult:
        known = self.prepared.get(ref.uid)
        try:
            if known is not None:
                self._rewrite_if_missing(known)
                logger.info("prepare %s: already prepared (%s)", ref, [d.device_name for d in known.devices])
                return PrepareResult(known.devices)
            claim = self._read(ref)
            cards = claim_cards(claim, ref, self.node_name, self.devices, self.unhealthy())
            devices = tuple(
                PreparedDevice(
                    c.request_names,
                    self.node_name,
                    device_name(c.device.index),
                    c.device.index,
                    (cdi_device_id(ref.uid, c.device.index),),
                )
                for c in cards
            )
            spec = build_cdi_spec(ref.uid, [c.device for c in cards], self.control_device)
            write_cdi_spec(self.cdi_dir, ref.uid, spec)
            self._save({**self.prepared, ref.uid: PreparedClaim(ref.uid, ref.namespace, ref.name, devices)})
        except (ClaimError, OSError) as exc:
            logger.warning("prepare %s failed: %s", ref, exc)
            return PrepareResult(error=str(exc))
        logger.info("prepared %s: %s", ref, [d.device_name for d in devices])
        return PrepareResult(devices)

    def _unprepare_one(self, ref: ClaimRef) -> str:
        try:
            removed = remove_cdi_spec(self.cdi_dir, ref.uid)
            if ref.uid in self.prepared:
                self._save({uid: c for uid, c in self.prepared.items() if uid != ref.uid})
        except OSError as exc:
            logger.warning("unprepare %s failed: %s", ref, exc)
            return str(exc)
        logger.info("unprepared %s%s", ref, "" if removed else " (nothing was prepared)")
        return ""

    def _read(self, ref: ClaimRef) -> Mapping[str, Any]:
        self.claim_reads += 1
        return self.claims.read_claim(ref.namespace, ref.name)

    def _rewrite_if_missing(self, claim: PreparedClaim) -> None:
        if spec_path(self.cdi_dir, claim.uid).exists():
            return
        cards = {d.index: d for d in self.devices}
        for prepared in claim.devices:
            if prepared.index not in cards:
                raise ClaimError(
                    f"claim {claim.namespace}/{claim.name} ({claim.uid}): checkpointed device "
                    f"{prepared.device_name} no longer exists on this node"
                )
        spec = build_cdi_spec(claim.uid, [cards[d.index] for d in claim.devices], self.control_device)
        write_cdi_spec(self.cdi_dir, claim.uid, spec)
        logger.warning("prepare %s: CDI spec was missing, written again", claim.uid)

    def _save(self, claims: dict[str, PreparedClaim]) -> None:
        save_checkpoint(self.checkpoint_file, claims)
        self.prepared = claims

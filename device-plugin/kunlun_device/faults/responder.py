"""`FaultResponder`: tells the pods on a failed card, quarantines flapping cards, taints a dead node.

Runs inside the device plugin, once per health round, in two steps:
- `observe(snapshot)` (in memory, fast): counts failures, quarantines a card that failed too often
  and returns the states for `ListAndWatch` — a quarantined card is Unhealthy whatever the checks say;
- `act()` (I/O): reads/writes the Node (quarantine and failure-history annotations, optional taint)
  every `node_sync_seconds` or when it has something to write, writes its state files, then asks
  kubelet's PodResources which pods hold our cards and patches the `kunlun.dev/xpu-healthy`
  condition of every pod whose verdict differs from the one last written (a new pod gets "True" at
  once: its readiness gate waits for it), and posts an Event on each pod holding a card whose
  health flipped.

The quarantine decisions are `QuarantineLedger`'s; with a `state_file` the last-known state is read
back at start, so until the Node answers only the cards quarantined last time are held Unhealthy.
Failed API calls are counted and logged once per target and reason (`ApiErrorLog`).

Invariant: a failed API call never stops the plugin; an unwritten verdict still differs next round
and is retried. Only this node's Node object and the pods kubelet says hold our cards are written.
After a restart every pod holding a card is written once again (what was written is not persisted).
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from kubernetes.client import CoreV1Api, CoreV1Event
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from kunlun_device.errors import FaultStateError
from kunlun_device.faults.api_errors import CREATE_EVENT, GET_NODE, PATCH_NODE, PATCH_POD_STATUS, ApiErrorLog
from kunlun_device.faults.ledger import QuarantineLedger
from kunlun_device.faults.quarantine import QuarantinePolicy
from kunlun_device.faults.state import StateFiles, read_state_file
from kunlun_device.faults.taint import build_taints, has_taint, taint_needed
from kunlun_device.faults.verdicts import (
    CardStatus,
    PodRef,
    PodVerdict,
    build_event,
    build_status_patch,
    events_due,
    pod_verdicts,
    verdicts_to_write,
)
from kunlun_device.labels import QUARANTINE_ANNOTATION
from kunlun_device.podresources import PodResourcesClient
from kunlun_device.xpu.health_tracker import HealthState
from kunlun_device.xpu.model import XpuDevice
from kunlun_device.xpu.monitor import HealthSnapshot

logger = logging.getLogger(__name__)
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
API_ERRORS = (ApiException, HTTPError)
#: (connect, read): with the client's retries off (cli), one call to an unreachable API server costs
#: at most a few seconds of the health thread; an unwritten verdict is retried next round anyway.
REQUEST_TIMEOUT_SECONDS = (2.0, 5.0)


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class FaultResponder:
    """The fault response of one node. Not thread-safe: call `observe` and `act` from one thread."""

    def __init__(
        self,
        devices: tuple[XpuDevice, ...],
        node_name: str,
        api: CoreV1Api,
        pod_resources: PodResourcesClient,
        policy: QuarantinePolicy | None = None,
        *,
        taint: bool = False,
        node_sync_seconds: float = 30.0,
        quarantine_file: Path | None = None,
        state_file: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], datetime.datetime] = _utcnow,
    ) -> None:
        self.node_name = node_name
        self.api = api
        self.pod_resources = pod_resources
        self.taint = taint
        self.node_sync_seconds = node_sync_seconds
        self._devices = {d.uuid: d for d in devices}
        self._clock, self._wall_clock = clock, wall_clock
        self.ledger = QuarantineLedger(
            {d.uuid: d.index for d in devices}, policy or QuarantinePolicy(), node_name
        )
        self.api_errors = ApiErrorLog()
        self._tracker: dict[str, HealthState] = dict.fromkeys(self._devices, HealthState.HEALTHY)
        self._details: dict[str, str] = {}  # the last transition's reason, per card
        self._reported = dict.fromkeys(self._devices, True)  # health of each card as last decided
        self._flipped: set[str] = set()  # cards whose flip is not yet turned into due Events
        self._written: dict[PodRef, tuple[PodVerdict, datetime.datetime]] = {}  # verdict, transition time
        self._events_due: set[tuple[PodRef, str]] = set()
        self._taint_on_node: bool | None = None
        self._next_sync = 0.0
        self._files = StateFiles(state_file, quarantine_file)
        self.pod_patches = 0
        self.events = 0
        if state_file is not None:
            self._restore(state_file)

    @property
    def quarantined(self) -> frozenset[str]:
        """UUIDs of this node's quarantined cards."""
        return self.ledger.quarantined

    def observe(self, snapshot: HealthSnapshot) -> dict[int, HealthState]:
        """Take one health round; returns the states to report to kubelet (quarantine applied)."""
        now = self._seconds()
        self._tracker = {d.uuid: snapshot.states[d.index] for d in self._devices.values()}
        for t in snapshot.transitions:
            self._details[t.uuid] = t.reason
            if t.after is HealthState.UNHEALTHY:
                self.ledger.record(t.uuid, t.reason, now)
        return self._states()

    def act(self, publish: Callable[[dict[int, HealthState]], object]) -> dict[int, HealthState]:
        """Write what the last rounds decided: the Node (when due) and the pods of changed cards.

        ``publish`` gets the states for kubelet after the Node is read and before any pod is
        written: reading the Node may have re-admitted a card, and kubelet must offer it again
        before its pods hear that it is healthy. Returns the same states.
        """
        now = self._clock()
        # Our taint goes whenever it is not wanted, also with the flag off: a node tainted before the
        # flag was turned off must not stay NoSchedule forever.
        wanted = self.taint and taint_needed(self._healthy(u) for u in self._devices)
        taint_due = wanted != self._taint_on_node if self.taint else bool(self._taint_on_node)
        if self.ledger.needs_write or taint_due or now >= self._next_sync:
            self._sync_node(now)
        states = self._states()
        publish(states)
        for uuid in self._devices:
            healthy = self._healthy(uuid)
            if healthy != self._reported[uuid]:
                self._reported[uuid] = healthy
                self._flipped.add(uuid)
        self._write_files()  # the quarantine is persisted (and exported) before any pod hears of it
        try:
            self._tell_pods()
        finally:
            self._write_files()  # this round's pod patches, counted
        return states

    # --- decisions on in-memory state ----------------------------------------------------------------

    def _seconds(self) -> float:
        """Now in Unix seconds (failure times are persisted, so they are wall-clock times)."""
        return round(self._wall_clock().timestamp(), 3)

    def _states(self) -> dict[int, HealthState]:
        return {
            d.index: HealthState.HEALTHY if self._healthy(d.uuid) else HealthState.UNHEALTHY
            for d in self._devices.values()
        }

    def _healthy(self, uuid: str) -> bool:
        return self._tracker[uuid] is HealthState.HEALTHY and uuid not in self.ledger.quarantined

    def _status(self, uuid: str) -> CardStatus:
        device, quarantined = self._devices[uuid], uuid in self.ledger.quarantined
        if quarantined:
            detail = self.ledger.details.get(uuid, f"quarantined ({QUARANTINE_ANNOTATION})")
        else:
            detail = self._details.get(uuid, "healthy")
        return CardStatus(device.index, uuid, self._healthy(uuid), quarantined, detail)

    # --- I/O -----------------------------------------------------------------------------------------

    def _restore(self, path: Path) -> None:
        """Start from the last-known state in `path`; without one, nothing is held (logged)."""
        try:
            self.ledger.restore(read_state_file(path), self._seconds(), str(path))
        except FaultStateError as exc:
            level = logging.INFO if exc.reason == "missing" else logging.WARNING  # missing: a first start
            logger.log(
                level,
                "no last-known quarantine (%s): until node %s is read, none is held",
                exc,
                self.node_name,
            )

    def _sync_node(self, now: float) -> None:
        """Read the Node: take re-admissions and hand-made quarantines; write ours and the taint."""
        try:
            node = self.api.read_node(self.node_name, _request_timeout=REQUEST_TIMEOUT_SECONDS)
        except API_ERRORS as exc:
            held = "cards held as last known" if not self.ledger.node_read else "quarantine not refreshed"
            self.api_errors.failed(GET_NODE, self.node_name, exc, f"{held}, retried every round")
            return
        self.api_errors.succeeded(GET_NODE, self.node_name)
        self._next_sync = now + self.node_sync_seconds
        annotations = (node.metadata.annotations if node.metadata else None) or {}
        changes, readmitted = self.ledger.sync(annotations, self._seconds())
        for uuid in readmitted:
            if self._tracker[uuid] is HealthState.HEALTHY:
                self._details[uuid] = (
                    f"re-admitted (removed from the node annotation {QUARANTINE_ANNOTATION})"
                )
        patch: dict[str, Any] = {"metadata": {"annotations": changes}} if changes else {}
        taints = self.api.api_client.sanitize_for_serialization(node.spec.taints if node.spec else None) or []
        self._taint_on_node = has_taint(taints)
        new_taints = build_taints(
            taints, self.taint and taint_needed(self._healthy(u) for u in self._devices)
        )
        if new_taints is not None:
            patch["spec"] = {"taints": new_taints}
        if patch:
            self._patch_node(patch, node.metadata.resource_version if node.metadata else None)
        else:
            self.ledger.written()  # the Node already holds everything decided here

    def _patch_node(self, patch: dict[str, Any], resource_version: str | None) -> None:
        # the resourceVersion guards against a concurrent re-admission: a conflict is retried next round
        patch.setdefault("metadata", {})["resourceVersion"] = resource_version
        try:
            self.api.patch_node(
                self.node_name, patch, _content_type=MERGE_PATCH, _request_timeout=REQUEST_TIMEOUT_SECONDS
            )
        except API_ERRORS as exc:
            self._next_sync = 0.0
            self.api_errors.failed(PATCH_NODE, self.node_name, exc, "quarantine/failures/taint not written")
            return
        self.api_errors.succeeded(PATCH_NODE, self.node_name)
        self.ledger.written()
        if "spec" in patch:
            self._taint_on_node = bool(patch["spec"]["taints"]) and has_taint(patch["spec"]["taints"])
        logger.info("node %s patched: %s", self.node_name, patch)

    def _write_files(self) -> None:
        self._files.write(
            replace(
                self.ledger.state(self._seconds()),
                api_errors=dict(self.api_errors.errors_total),
                pods_unwritten=len(self.api_errors.failing(PATCH_POD_STATUS)),
            )
        )

    def _tell_pods(self) -> None:
        errors_before = self.pod_resources.errors_total
        holders = self.pod_resources.holders()
        if self.pod_resources.errors_total != errors_before:
            return  # kubelet could not be asked: retry next round
        self._events_due |= events_due(holders, self._flipped)
        self._flipped.clear()
        cards = {uuid: self._status(uuid) for uuid in self._devices}
        verdicts = pod_verdicts(holders, cards, self.node_name)
        present = {v.pod for v in verdicts}
        self._written = {pod: w for pod, w in self._written.items() if pod in present}
        self._events_due = {(pod, uuid) for pod, uuid in self._events_due if pod in present}
        for call in (PATCH_POD_STATUS, CREATE_EVENT):  # a pod that is gone is no longer failing
            self.api_errors.keep_only(call, [f"{p.namespace}/{p.name}" for p in present])
        written = {pod: verdict for pod, (verdict, _) in self._written.items()}
        unwritten: set[PodRef] = set()
        for verdict in verdicts_to_write(verdicts, written):
            previous = self._written.get(verdict.pod)
            same_status = previous is not None and previous[0].healthy == verdict.healthy
            since = previous[1] if previous is not None and same_status else self._wall_clock()
            delivered, uid = self._patch_pod(verdict.pod, build_status_patch(verdict, since))
            if not delivered:
                unwritten.add(verdict.pod)  # retried next round, its Events with it
                continue
            self._written[verdict.pod] = (verdict, since)
            if uid is None:
                continue  # the pod is gone
            status = "True" if verdict.healthy else "False"
            logger.info(
                "pod %s/%s: %s (%s)", verdict.pod.namespace, verdict.pod.name, status, verdict.message
            )
            for pod, uuid in sorted(self._events_due, key=lambda e: (e[0], cards[e[1]].index)):
                if pod == verdict.pod:
                    self._post_event(build_event(pod, uid, cards[uuid], self.node_name, self._wall_clock()))
                    self._events_due.discard((pod, uuid))
        self._events_due = {(pod, uuid) for pod, uuid in self._events_due if pod in unwritten}

    def _patch_pod(self, pod: PodRef, patch: dict[str, Any]) -> tuple[bool, str | None]:
        """(delivered, the pod's uid); a pod that is gone counts as delivered, with no uid."""
        target = f"{pod.namespace}/{pod.name}"
        try:
            result = self.api.patch_namespaced_pod_status(
                pod.name,
                pod.namespace,
                patch,
                _content_type=STRATEGIC_MERGE_PATCH,
                _request_timeout=REQUEST_TIMEOUT_SECONDS,
            )
        except API_ERRORS as exc:
            if isinstance(exc, ApiException) and exc.status == 404:
                self.api_errors.succeeded(PATCH_POD_STATUS, target)
                return True, None
            self.api_errors.failed(
                PATCH_POD_STATUS, target, exc, "condition not written, retried every round"
            )
            return False, None
        self.api_errors.succeeded(PATCH_POD_STATUS, target)
        self.pod_patches += 1
        metadata = getattr(result, "metadata", None)
        uid = getattr(metadata, "uid", None)
        return True, uid if isinstance(uid, str) else None

    def _post_event(self, event: dict[str, Any]) -> None:
        namespace, pod = event["metadata"]["namespace"], event["involvedObject"]["name"]
        try:
            body = CoreV1Event.from_dict(event)
            assert body is not None
            self.api.create_namespaced_event(namespace, body, _request_timeout=REQUEST_TIMEOUT_SECONDS)
        except API_ERRORS as exc:
            self.api_errors.failed(
                CREATE_EVENT, f"{namespace}/{pod}", exc, f"Event {event['reason']} dropped"
            )
            return
        self.api_errors.succeeded(CREATE_EVENT, f"{namespace}/{pod}")
        self.events += 1

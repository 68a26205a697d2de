"""`QuarantineLedger`: which cards are quarantined and how often each failed, and what of it the Node
must be told — the decisions behind the two Node annotations, with no I/O.

The Node is the authority once read: `kunlun.dev/xpu-quarantine` (card UUIDs) and
`kunlun.dev/xpu-failures` (failure times, `kunlun_device.faults.history`). What the plugin decided
but has not written yet ("unwritten": a quarantine, a failure) is kept apart and merged into what
the Node says until a write succeeds, so neither an unreachable API nor a restart loses it. Until
the plugin has read its Node once after a start, it holds the cards of its last-known state
(`restore`, from the node-local state file) quarantined — those cards only.

Invariant: `quarantined` only ever names this node's cards; a card is re-admitted only because the
Node no longer names it (never because the API could not be read).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from kunlun_device.errors import FaultStateError
from kunlun_device.faults.history import format_failures, parse_failures
from kunlun_device.faults.quarantine import (
    FailureWindow,
    History,
    QuarantinePolicy,
    format_quarantine,
    future_failures,
    invalid_quarantine_entries,
    is_future,
    parse_quarantine,
    prune_history,
)
from kunlun_device.faults.state import FaultState
from kunlun_device.labels import FAILURES_ANNOTATION, QUARANTINE_ANNOTATION

logger = logging.getLogger(__name__)


class QuarantineLedger:
    """The quarantine and failure counts of one node's cards (UUID -> index in `cards`)."""

    def __init__(self, cards: Mapping[str, int], policy: QuarantinePolicy, node_name: str) -> None:
        self.cards = dict(cards)
        self.node_name = node_name
        self.window = FailureWindow(policy)
        self.quarantined: frozenset[str] = frozenset()
        self.unwritten: frozenset[str] = frozenset()  # quarantined here, not yet on the Node
        self.unwritten_failures: dict[str, set[float]] = {}  # counted here, not yet on the Node
        self.node_read = False  # read since start: the Node's annotations are the authority
        self.details: dict[str, str] = {}  # why each quarantined card is quarantined
        self._held: set[str] = set()  # quarantined from the last-known state, the Node not read yet
        self._reasons: dict[str, str] = {}  # each card's last failure, for the quarantine message
        self._warned: set[tuple[str, str]] = set()  # (annotation, value) already reported malformed
        self._future: set[tuple[str, float]] = set()  # (card, time) already reported in the future

    @property
    def needs_write(self) -> bool:
        """Something decided here is not on the Node yet."""
        return bool(self.unwritten or self.unwritten_failures)

    def restore(self, state: FaultState, now: float, source: str) -> frozenset[str]:
        """Start from the last-known state (read from `source`, the plugin's state file); returns the
        cards now held quarantined until the Node is read."""
        ours = frozenset(self.cards)
        self.quarantined = state.quarantined & ours
        self.unwritten = state.unwritten_quarantine & ours
        self._held = set(self.quarantined)
        for uuid in self.quarantined:
            self.details[uuid] = (
                f"quarantined (last-known state: node {self.node_name} not read since the plugin started)"
            )
        failures = {u: t for u, t in state.failures.items() if u in ours}
        self.unwritten_failures = {u: set(t) for u, t in state.unwritten_failures.items() if u in ours}
        self._drop_future(now, source, failures)
        self.window.replace(failures, now)
        held = sorted(self.quarantined, key=self.cards.__getitem__)
        logger.warning(
            "until node %s is read, holding %s Unhealthy as quarantined in the last-known state %s",
            self.node_name,
            ", ".join(f"xpu{self.cards[u]} ({u})" for u in held) or "no card",
            source,
        )
        return self.quarantined

    def record(self, uuid: str, reason: str, now: float) -> bool:
        """Count one failure of `uuid` at `now` (Unix seconds); True when it quarantines the card.
        A quarantined card's failures are not counted: it is out until re-admitted, then counts afresh."""
        if uuid in self.quarantined:
            return False
        self._reasons[uuid] = reason
        self._drop_future(now, f"node {self.node_name}", self.window.future(now))
        self.unwritten_failures.setdefault(uuid, set()).add(now)
        if not self.window.record(uuid, now):
            return False
        self._quarantine(uuid)
        return True

    def _quarantine(self, uuid: str) -> None:
        """Quarantine `uuid` for failing too often; its failure history has served and is dropped
        (so a re-admission never meets a full count again)."""
        policy, failures = self.window.policy, self.window.count(uuid)
        reason = self._reasons.get(uuid, "counted before the plugin restarted")
        self.window.forget(uuid)
        self.unwritten_failures.pop(uuid, None)
        self.quarantined |= {uuid}
        self.unwritten |= {uuid}
        self._held.discard(uuid)
        self.details[uuid] = (
            f"quarantined after {failures} failures within {policy.window_seconds:g}s (last: {reason}); "
            f"re-admit by removing {uuid} from the node annotation {QUARANTINE_ANNOTATION}"
        )
        logger.warning(
            "xpu%d (%s) quarantined: %d failures within %gs",
            self.cards[uuid],
            uuid,
            failures,
            policy.window_seconds,
        )

    def sync(
        self, annotations: Mapping[str, str], now: float
    ) -> tuple[dict[str, str | None], frozenset[str]]:
        """Take what the Node says; returns (annotation changes to write, cards re-admitted).

        The failures on the Node plus those not yet written may reach the threshold (failures
        counted before a restart): the card is quarantined here.
        """
        ours = frozenset(self.cards)
        on_node = parse_quarantine(annotations.get(QUARANTINE_ANNOTATION))
        self._check_quarantine(annotations.get(QUARANTINE_ANNOTATION))
        readmitted = frozenset(self.quarantined - self.unwritten - on_node)
        for uuid in sorted(readmitted):
            self.window.forget(uuid)
            self.unwritten_failures.pop(uuid, None)
            logger.info("xpu%d (%s) re-admitted from quarantine", self.cards[uuid], uuid)
        for uuid in sorted((on_node & ours) - (self.quarantined - self._held)):
            self.details[uuid] = f"quarantined by the node annotation {QUARANTINE_ANNOTATION}"
        self._held.clear()
        self.quarantined = (on_node & ours) | self.unwritten
        self.node_read = True
        raw = annotations.get(FAILURES_ANNOTATION)
        stale, value = self._sync_failures(raw, ours - readmitted - self.quarantined, now)
        changes: dict[str, str | None] = {}
        wanted = on_node | self.unwritten
        if wanted != on_node:
            changes[QUARANTINE_ANNOTATION] = format_quarantine(wanted)
        if stale:
            changes[FAILURES_ANNOTATION] = value  # None removes it
        return changes, readmitted

    def _sync_failures(self, raw: str | None, cards: frozenset[str], now: float) -> tuple[bool, str | None]:
        """Count from the Node's failures plus the unwritten ones; returns (whether the Node's value
        must change, the new value). A malformed value is replaced only when there is something to say."""
        node_history = self._node_history(raw)
        known = node_history or {}
        node_future = future_failures(known, now)
        self._drop_future(now, f"node {self.node_name}: {FAILURES_ANNOTATION}", node_future)
        self.window.replace({u: (*known.get(u, ()), *self.unwritten_failures.get(u, ())) for u in cards}, now)
        for uuid in sorted(cards, key=self.cards.__getitem__):
            if self.window.count(uuid) >= self.window.policy.max_failures:
                self._quarantine(uuid)
        history = self.window.history(now)
        if node_history is None:
            stale = bool(history)
        else:
            # a future time goes from the Node too: left there, it would count once the clock reached it
            stale = bool(node_future) or prune_history(node_history, now, self.window.policy) != history
        return stale, format_failures(history)

    def written(self) -> None:
        """The Node now holds what was decided here (the patch built by `sync` succeeded)."""
        self.unwritten = frozenset()
        self.unwritten_failures = {}

    def state(self, now: float) -> FaultState:
        """What to persist (the counters of API calls are the caller's)."""
        return FaultState(
            quarantined=self.quarantined,
            unwritten_quarantine=self.unwritten,
            failures=self.window.history(now),
            unwritten_failures=prune_history(self.unwritten_failures, now, self.window.policy),
            node_read=self.node_read,
        )

    def _drop_future(self, now: float, source: str, *found: Mapping[str, tuple[float, ...]]) -> None:
        """Drop the future failure times (`is_future`) from the unwritten failures; log once each
        (card, time) of them and of `found` (times from `source`, which the caller drops)."""
        future = future_failures(self.unwritten_failures, now)
        self.unwritten_failures = {
            u: kept
            for u, times in self.unwritten_failures.items()
            if (kept := {t for t in times if not is_future(t, now)})
        }
        for history in found:
            for uuid, times in future_failures(history, now).items():
                future[uuid] = (*future.get(uuid, ()), *times)
        for uuid in sorted(future):
            new = sorted({t for t in future[uuid] if (uuid, t) not in self._future})
            if not new:
                continue
            self._future.update((uuid, t) for t in new)
            logger.warning(
                "%s: failure times of %s later than now (%.3f) ignored, clock stepped back or edited by hand: %s",
                source,
                uuid,
                now,
                ", ".join(f"{t:.3f}" for t in new),
            )

    def _node_history(self, raw: str | None) -> History | None:
        """The Node's failure history; None (reported once per value) when malformed."""
        try:
            return parse_failures(raw)
        except FaultStateError as exc:
            self._warn_once(FAILURES_ANNOTATION, raw or "", f"node {self.node_name}: {exc}; ignored")
            return None

    def _check_quarantine(self, raw: str | None) -> None:
        invalid = invalid_quarantine_entries(raw)
        if invalid:
            self._warn_once(
                QUARANTINE_ANNOTATION,
                raw or "",
                f"node {self.node_name}: annotation {QUARANTINE_ANNOTATION}: {invalid} are not card UUIDs "
                "(expected comma-separated UUIDs); ignored",
            )

    def _warn_once(self, annotation: str, value: str, message: str) -> None:
        if (annotation, value) not in self._warned:
            self._warned.add((annotation, value))
            logger.warning("%s", message)

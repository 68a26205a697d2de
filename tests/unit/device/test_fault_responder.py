"""`FaultResponder` round by round against an in-memory API and PodResources (no sockets, no HTTP):
what it writes when, what it retries, what it leaves alone, what a restart keeps."""

from __future__ import annotations

import datetime
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes
import pytest
from kubernetes.client import V1Node, V1NodeSpec, V1ObjectMeta, V1Pod
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import MaxRetryError, NewConnectionError

from kunlun_device.faults import FaultResponder, QuarantinePolicy, read_state_file
from kunlun_device.podresources import Holder
from kunlun_device.xpu.health_tracker import HealthState, Transition
from kunlun_device.xpu.model import XpuDevice
from kunlun_device.xpu.monitor import HealthSnapshot

H, U = HealthState.HEALTHY, HealthState.UNHEALTHY
DEVICES = tuple(XpuDevice(i, f"GPU-{i}", "P800 OAM", 1, f"bus{i}", 0, f"/dev/xpu{i}", None) for i in range(2))


@dataclass
class FakeApi:
    """The CoreV1Api calls the responder makes, recorded; `fail_pods` answers that many pod patches with
    500, `deny_pods` every pod patch with 403 while set, and `down` makes every call unreachable."""

    annotations: dict[str, str] = field(default_factory=dict)
    taints: list[dict[str, Any]] = field(default_factory=list)
    gone: set[str] = field(default_factory=set)
    fail_pods: int = 0
    deny_pods: bool = False
    down: bool = False
    pod_patches: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    node_patches: list[dict[str, Any]] = field(default_factory=list)
    events: list[tuple[str, str]] = field(default_factory=list)
    api_client: Any = field(default_factory=kubernetes.client.ApiClient)

    def _reach(self) -> None:
        if self.down:
            refused = NewConnectionError(None, "Connection refused")  # type: ignore[arg-type]
            raise MaxRetryError(None, "/api/v1/nodes/n1", refused)  # type: ignore[arg-type]

    def read_node(self, name: str, **_: Any) -> V1Node:
        self._reach()
        spec = V1NodeSpec(taints=[kubernetes.client.V1Taint(**t) for t in self.taints] or None)
        return V1Node(
            metadata=V1ObjectMeta(name=name, annotations=dict(self.annotations), resource_version="7"),
            spec=spec,
        )

    def patch_node(self, name: str, body: dict[str, Any], **_: Any) -> None:
        self._reach()
        self.node_patches.append(body)
        for key, value in body.get("metadata", {}).get("annotations", {}).items():
            if value is None:
                self.annotations.pop(key, None)
            else:
                self.annotations[key] = value
        if "spec" in body:
            self.taints = body["spec"]["taints"]

    def patch_namespaced_pod_status(self, name: str, namespace: str, body: dict[str, Any], **_: Any) -> V1Pod:
        self._reach()
        if self.deny_pods:
            denied = ApiException(status=403, reason="Forbidden")
            denied.body = json.dumps({"kind": "Status", "message": f'pods "{name}" is forbidden'})
            raise denied
        if self.fail_pods:
            self.fail_pods -= 1
            raise ApiException(status=500)
        if name in self.gone:
            raise ApiException(status=404)
        self.pod_patches.append((name, body["status"]["conditions"][0]))
        return V1Pod(metadata=V1ObjectMeta(name=name, uid=f"uid-{name}"))

    def create_namespaced_event(self, namespace: str, body: Any, **_: Any) -> None:
        self.events.append((body.involved_object.name, body.reason))


@dataclass
class FakePods:
    holders_now: dict[str, Holder] = field(default_factory=dict)
    down: bool = False
    errors_total: int = 0

    def holders(self) -> dict[str, Holder]:
        if self.down:
            self.errors_total += 1
            return {}
        return dict(self.holders_now)


START = datetime.datetime(2026, 12, 1, 3, 0, 0, tzinfo=datetime.UTC)
T0 = START.timestamp()  # in Unix seconds, as failure times are persisted


class Clocks:
    def __init__(self) -> None:
        self.monotonic = 0.0
        self.wall = START

    def tick(self, seconds: float) -> None:
        self.monotonic += seconds
        self.wall += datetime.timedelta(seconds=seconds)


def make_responder(
    api: FakeApi, pods: FakePods, clocks: Clocks, policy: QuarantinePolicy | None = None, **kwargs: Any
) -> FaultResponder:
    return FaultResponder(
        DEVICES,
        "n1",
        api,  # type: ignore[arg-type]
        pods,  # type: ignore[arg-type]
        policy or QuarantinePolicy(2, 600),
        node_sync_seconds=30,
        clock=lambda: clocks.monotonic,
        wall_clock=lambda: clocks.wall,
        **kwargs,
    )


def snapshot(states: tuple[HealthState, HealthState], *transitions: Transition) -> HealthSnapshot:
    return HealthSnapshot(None, None, {}, dict(enumerate(states)), tuple(transitions))


def fail(index: int, reason: str = "ecc") -> Transition:
    return Transition(index, f"GPU-{index}", H, U, reason)


def heal(index: int) -> Transition:
    return Transition(index, f"GPU-{index}", U, H, "no fault for 60s")


def round_(responder: FaultResponder, snap: HealthSnapshot) -> dict[int, HealthState]:
    responder.observe(snap)
    published: list[dict[int, HealthState]] = []
    states = responder.act(published.append)
    assert published == [states]  # kubelet hears the states once, before any pod is written
    return states


def test_status_time_is_kept_when_only_the_message_changes() -> None:
    api, pods, clocks = (
        FakeApi(),
        FakePods({"GPU-0": Holder("ml", "a", "r"), "GPU-1": Holder("ml", "a", "r")}),
        Clocks(),
    )
    responder = make_responder(api, pods, clocks)
    round_(responder, snapshot((H, H)))
    clocks.tick(10)
    round_(responder, snapshot((U, H), fail(0)))
    clocks.tick(10)
    round_(responder, snapshot((U, U), fail(1)))
    clocks.tick(10)
    round_(responder, snapshot((U, U)))  # nothing new: nothing written
    assert [(c["status"], c["lastTransitionTime"], c["message"]) for _, c in api.pod_patches] == [
        ("True", "2026-12-01T03:00:00Z", "node n1: healthy: xpu0 (GPU-0), xpu1 (GPU-1)"),
        ("False", "2026-12-01T03:00:10Z", "node n1: xpu0 (GPU-0): ecc"),
        ("False", "2026-12-01T03:00:10Z", "node n1: xpu0 (GPU-0): ecc; xpu1 (GPU-1): ecc"),
    ]
    assert api.events == [("a", "XpuUnhealthy"), ("a", "XpuUnhealthy")]


def test_unreachable_kubelet_or_api_is_retried_and_a_gone_pod_is_not() -> None:
    api, pods, clocks = (
        FakeApi(gone={"b"}),
        FakePods({"GPU-0": Holder("ml", "a", "r"), "GPU-1": Holder("ml", "b", "r")}),
        Clocks(),
    )
    pods.down = True
    responder = make_responder(api, pods, clocks)
    round_(responder, snapshot((H, H)))
    assert api.pod_patches == []
    pods.down = False
    api.fail_pods = 1
    round_(responder, snapshot((U, H), fail(0)))  # a failed, b gone (404)
    assert api.pod_patches == [] and api.events == []
    round_(responder, snapshot((U, H)))
    round_(responder, snapshot((U, H)))
    assert [(name, c["status"]) for name, c in api.pod_patches] == [("a", "False")]  # once, b never again
    assert api.events == [("a", "XpuUnhealthy")]


def test_quarantine_survives_recovery_and_a_restart_reads_it_back() -> None:
    api, pods, clocks = FakeApi(annotations={"team": "ml"}), FakePods(), Clocks()
    responder = make_responder(api, pods, clocks)
    round_(responder, snapshot((H, H)))
    round_(responder, snapshot((U, H), fail(0)))
    round_(responder, snapshot((H, H), heal(0)))
    assert round_(responder, snapshot((U, H), fail(0))) == {0: U, 1: H}
    assert api.annotations == {"team": "ml", "kunlun.dev/xpu-quarantine": "GPU-0"}
    assert api.node_patches[-1]["metadata"]["resourceVersion"] == "7"
    assert round_(responder, snapshot((H, H), heal(0))) == {0: U, 1: H}  # checks pass, still out

    restarted = make_responder(api, pods, Clocks())
    assert round_(restarted, snapshot((H, H))) == {0: U, 1: H}
    del api.annotations["kunlun.dev/xpu-quarantine"]  # the operator re-admits it
    clocks.tick(30)
    assert round_(responder, snapshot((H, H))) == {0: H, 1: H}


def test_taint_follows_the_last_healthy_card_and_keeps_other_taints() -> None:
    other = {"key": "gpu", "effect": "NoSchedule"}
    api, pods, clocks = FakeApi(taints=[other]), FakePods(), Clocks()
    responder = make_responder(api, pods, clocks, taint=True)
    round_(responder, snapshot((H, H)))
    round_(responder, snapshot((U, H), fail(0)))
    assert [p for p in api.node_patches if "spec" in p] == []  # (the failure count is written)
    round_(responder, snapshot((U, U), fail(1)))
    assert api.taints == [other, {"key": "kunlun.dev/xpu-unhealthy", "value": "true", "effect": "NoSchedule"}]
    round_(responder, snapshot((U, U)))
    assert len([p for p in api.node_patches if "spec" in p]) == 1  # not written again
    round_(responder, snapshot((U, H), heal(1)))
    assert api.taints == [other]


def test_our_taint_is_removed_once_the_flag_is_off_and_others_are_kept() -> None:
    other = {"key": "gpu", "effect": "NoSchedule"}
    ours = {"key": "kunlun.dev/xpu-unhealthy", "value": "true", "effect": "NoSchedule"}
    api, pods, clocks = FakeApi(taints=[other, ours]), FakePods(), Clocks()  # tainted while the flag was on
    responder = make_responder(api, pods, clocks, taint=False)
    round_(responder, snapshot((U, U)))  # every card Unhealthy, yet the flag is off: the taint goes
    assert api.taints == [other]
    round_(responder, snapshot((U, U)))
    assert len(api.node_patches) == 1  # not written again


# --- what a restart keeps; an unreachable API at start; a denied pod patch -------------------------


def test_failure_counts_survive_a_restart_on_the_node() -> None:
    api, pods, clocks = FakeApi(), FakePods(), Clocks()
    three = QuarantinePolicy(3, 600)
    responder = make_responder(api, pods, clocks, three)
    round_(responder, snapshot((H, H)))
    for _ in range(2):  # two failures of card 0, each on the Node at once
        clocks.tick(10)
        round_(responder, snapshot((U, H), fail(0)))
        clocks.tick(10)
        round_(responder, snapshot((H, H), heal(0)))
    failures = f'{{"failures":{{"GPU-0":[{T0 + 10},{T0 + 30}]}},"version":1}}'
    assert api.annotations == {"kunlun.dev/xpu-failures": failures}

    restarted = make_responder(api, pods, clocks, three)  # a new process: nothing in memory
    clocks.tick(10)
    assert round_(restarted, snapshot((U, H), fail(0))) == {0: U, 1: H}  # the third failure
    assert restarted.quarantined == {"GPU-0"}
    assert api.annotations == {"kunlun.dev/xpu-quarantine": "GPU-0"}  # its count has served
    clocks.tick(10)
    assert round_(restarted, snapshot((H, H), heal(0))) == {0: U, 1: H}  # checks pass, still out


def test_failures_counted_before_the_node_is_read_join_the_nodes_count() -> None:
    api, pods, clocks = FakeApi(), FakePods(), Clocks()
    api.annotations["kunlun.dev/xpu-failures"] = (
        f'{{"failures":{{"GPU-1":[{T0 - 20},{T0 - 10}]}},"version":1}}'
    )
    responder = make_responder(api, pods, clocks, QuarantinePolicy(3, 600))
    responder.observe(snapshot((H, U), fail(1)))  # the plugin's first poll, before its first Node read
    assert round_(responder, snapshot((H, U))) == {0: H, 1: U}
    assert api.annotations == {"kunlun.dev/xpu-quarantine": "GPU-1"}
    assert "quarantined after 3 failures within 600s (last: ecc)" in responder.ledger.details["GPU-1"]


def test_unreachable_api_at_start_holds_only_the_last_known_quarantined_card(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state, exported = tmp_path / "state.json", tmp_path / "quarantine.json"
    api, pods, clocks = FakeApi(), FakePods({"GPU-0": Holder("ml", "a", "r")}), Clocks()
    before = make_responder(api, pods, clocks, state_file=state, quarantine_file=exported)
    round_(before, snapshot((H, H)))
    round_(before, snapshot((U, H), fail(0)))
    clocks.tick(10)
    round_(before, snapshot((H, H), heal(0)))
    clocks.tick(10)
    assert round_(before, snapshot((U, H), fail(0))) == {0: U, 1: H}  # quarantined, on the Node
    assert read_state_file(state).quarantined == {"GPU-0"}

    api.down = True  # the plugin restarts while the API cannot be reached
    caplog.clear()
    after = make_responder(api, pods, clocks, state_file=state, quarantine_file=exported)
    for _ in range(3):
        clocks.tick(10)
        assert round_(after, snapshot((H, H))) == {0: U, 1: H}  # card 0 held, card 1 follows its checks
    assert not read_state_file(exported).node_read  # visible: kunlun_xpu_fault_node_read 0
    assert read_state_file(exported).api_errors["get_node"] == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"until node n1 is read, holding xpu0 (GPU-0) Unhealthy as quarantined in the last-known state {state}",
        "get_node n1 failed, cards held as last known, retried every round: unreachable (NewConnectionError)",
        "patch_pod_status ml/a failed, condition not written, retried every round: "
        "unreachable (NewConnectionError)",
    ]  # once each, not once per round

    del api.annotations["kunlun.dev/xpu-quarantine"]  # an operator re-admitted it meanwhile
    api.down = False
    clocks.tick(10)
    assert round_(after, snapshot((H, H))) == {0: H, 1: H}  # the Node is the authority again
    assert read_state_file(exported).node_read
    assert read_state_file(state).quarantined == frozenset()
    assert api.pod_patches[-1][1]["status"] == "True"


def test_a_corrupt_state_file_holds_nothing_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "state.json"
    state.write_text('{"format": 1, "quarantined": "GPU-0"}')
    api, pods, clocks = FakeApi(down=True), FakePods(), Clocks()
    responder = make_responder(api, pods, clocks, state_file=state)
    assert round_(responder, snapshot((H, H))) == {0: H, 1: H}
    assert any(
        r.getMessage().startswith(f"no last-known quarantine ({state}: fields ") for r in caplog.records
    )


def test_denied_pod_patch_is_counted_logged_once_and_retried(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    exported = tmp_path / "quarantine.json"
    api, pods, clocks = FakeApi(deny_pods=True), FakePods({"GPU-0": Holder("ml", "a", "r")}), Clocks()
    caplog.set_level(logging.INFO, logger="kunlun_device.faults")
    responder = make_responder(api, pods, clocks, quarantine_file=exported)
    for _ in range(3):
        round_(responder, snapshot((H, H)))
    assert api.pod_patches == []
    counted = read_state_file(exported)
    assert (counted.api_errors["patch_pod_status"], counted.pods_unwritten) == (3, 1)
    denied = (
        "patch_pod_status ml/a failed, condition not written, retried every round: "
        'HTTP 403 Forbidden: pods "a" is forbidden'
    )
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [denied]

    api.deny_pods = False  # RBAC fixed
    round_(responder, snapshot((H, H)))
    assert [(name, c["status"]) for name, c in api.pod_patches] == [("a", "True")]
    assert read_state_file(exported).pods_unwritten == 0
    assert caplog.records[-2].getMessage() == (
        'patch_pod_status ml/a succeeded again (it failed with: HTTP 403 Forbidden: pods "a" is forbidden)'
    )


def test_a_call_failing_every_round_does_not_rewrite_the_state_file(tmp_path: Path) -> None:
    state, exported = tmp_path / "state.json", tmp_path / "quarantine.json"
    api, pods, clocks = FakeApi(deny_pods=True), FakePods({"GPU-0": Holder("ml", "a", "r")}), Clocks()
    responder = make_responder(api, pods, clocks, state_file=state, quarantine_file=exported)
    round_(responder, snapshot((H, H)))
    written = state.stat().st_ino  # each write replaces the file: a new inode
    for _ in range(2):  # the same state, the pod patch still denied
        clocks.tick(10)
        round_(responder, snapshot((H, H)))
    assert read_state_file(exported).api_errors["patch_pod_status"] == 3  # the exporter's file counts
    assert state.stat().st_ino == written  # the host file was written once
    assert read_state_file(state).api_errors == {} and read_state_file(state).pods_unwritten == 0

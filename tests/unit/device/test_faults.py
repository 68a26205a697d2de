"""The fault response's pure decisions: which pods, which condition and Event, quarantine window, taint."""

from __future__ import annotations

import datetime

import pytest

from kunlun_device.api import podresources_v1_pb2 as pr
from kunlun_device.errors import ConfigError
from kunlun_device.faults.quarantine import (
    FailureWindow,
    QuarantinePolicy,
    format_quarantine,
    invalid_quarantine_entries,
    parse_quarantine,
)
from kunlun_device.faults.taint import build_taints, taint_needed
from kunlun_device.faults.verdicts import (
    CardStatus,
    PodRef,
    PodVerdict,
    build_event,
    build_status_patch,
    cards_by_pod,
    events_due,
    pod_verdicts,
    verdicts_to_write,
)
from kunlun_device.podresources import Holder, parse_list_response

NOW = datetime.datetime(2026, 12, 1, 3, 4, 5, tzinfo=datetime.UTC)
OURS = {"key": "kunlun.dev/xpu-unhealthy", "value": "true", "effect": "NoSchedule"}


def make_card(index: int, healthy: bool = True, quarantined: bool = False, detail: str = "ok") -> CardStatus:
    return CardStatus(index, f"GPU-{index}", healthy, quarantined, detail)


def make_response() -> pr.ListPodResourcesResponse:
    """Pod a holds cards 4 and 5 (two containers), pod b card 0, pod c a GPU only."""

    def container(name: str, resource: str, ids: list[str]) -> pr.ContainerResources:
        return pr.ContainerResources(
            name=name, devices=[pr.ContainerDevices(resource_name=resource, device_ids=ids)]
        )

    return pr.ListPodResourcesResponse(
        pod_resources=[
            pr.PodResources(
                name="a",
                namespace="ml",
                containers=[
                    container("r0", "kunlunxin.com/xpu", ["GPU-4"]),
                    container("r1", "kunlunxin.com/xpu", ["GPU-5"]),
                ],
            ),
            pr.PodResources(
                name="b", namespace="ml", containers=[container("r", "kunlunxin.com/xpu", ["GPU-0"])]
            ),
            pr.PodResources(
                name="c", namespace="ml", containers=[container("r", "nvidia.com/gpu", ["GPU-1"])]
            ),
        ]
    )


HOLDERS = parse_list_response(make_response())
CARDS = {c.uuid: c for c in (make_card(0), make_card(4), make_card(5))}


# --- which pods -----------------------------------------------------------------------------------


def test_cards_by_pod_groups_the_containers_of_a_pod_and_ignores_other_resources() -> None:
    assert HOLDERS["GPU-4"] == Holder("ml", "a", "r0")
    assert cards_by_pod(HOLDERS) == {
        PodRef("ml", "a"): frozenset({"GPU-4", "GPU-5"}),
        PodRef("ml", "b"): frozenset({"GPU-0"}),
    }


def test_pod_holding_a_failed_card_is_false_naming_card_and_check() -> None:
    ecc = "ecc-uncorrectable: 3 uncorrectable ECC errors"
    cards = CARDS | {"GPU-5": make_card(5, healthy=False, detail=ecc)}
    assert pod_verdicts(HOLDERS, cards, "n1") == [
        PodVerdict(PodRef("ml", "a"), False, "XpuUnhealthy", f"node n1: xpu5 (GPU-5): {ecc}"),
        PodVerdict(PodRef("ml", "b"), True, "XpuHealthy", "node n1: healthy: xpu0 (GPU-0)"),
    ]


def test_pod_stays_false_while_another_of_its_cards_is_unhealthy() -> None:
    cards = CARDS | {"GPU-4": make_card(4, healthy=False, quarantined=True, detail="quarantined after 3")}
    verdict, _ = pod_verdicts(HOLDERS, cards, "n1")  # card 5 recovered, card 4 did not
    assert (verdict.healthy, verdict.reason, verdict.message) == (
        False,
        "XpuQuarantined",
        "node n1: xpu4 (GPU-4): quarantined after 3",
    )


def test_pod_is_true_when_all_its_cards_are_healthy() -> None:
    assert pod_verdicts(HOLDERS, CARDS, "n1") == [
        PodVerdict(PodRef("ml", "a"), True, "XpuHealthy", "node n1: healthy: xpu4 (GPU-4), xpu5 (GPU-5)"),
        PodVerdict(PodRef("ml", "b"), True, "XpuHealthy", "node n1: healthy: xpu0 (GPU-0)"),
    ]


def test_pod_holding_only_unknown_cards_gets_no_verdict() -> None:
    assert pod_verdicts({"GPU-9": Holder("ml", "x", "r")}, CARDS, "n1") == []


def test_only_new_or_changed_verdicts_are_written() -> None:
    a_false = PodVerdict(PodRef("ml", "a"), False, "XpuUnhealthy", "node n1: xpu5 (GPU-5): ecc")
    b_true = PodVerdict(PodRef("ml", "b"), True, "XpuHealthy", "node n1: healthy: xpu0 (GPU-0)")
    assert verdicts_to_write([a_false, b_true], {}) == [a_false, b_true]  # new pods: b's True as well
    assert verdicts_to_write([a_false, b_true], {b_true.pod: b_true}) == [a_false]
    a_other = PodVerdict(PodRef("ml", "a"), False, "XpuUnhealthy", "node n1: xpu4 (GPU-4): ecc")
    assert verdicts_to_write([a_other, b_true], {a_false.pod: a_false, b_true.pod: b_true}) == [a_other]


def test_events_are_due_for_every_pod_holding_a_flipped_card() -> None:
    assert events_due(HOLDERS, {"GPU-5", "GPU-0", "GPU-7"}) == {
        (PodRef("ml", "a"), "GPU-5"),
        (PodRef("ml", "b"), "GPU-0"),
    }


# --- what to write --------------------------------------------------------------------------------


def test_status_patch_sets_the_contract_condition() -> None:
    verdict = PodVerdict(PodRef("ml", "a"), False, "XpuUnhealthy", "node n1: xpu5 (GPU-5): x")
    assert build_status_patch(verdict, NOW) == {
        "status": {
            "conditions": [
                {
                    "type": "kunlun.dev/xpu-healthy",
                    "status": "False",
                    "reason": "XpuUnhealthy",
                    "message": "node n1: xpu5 (GPU-5): x",
                    "lastTransitionTime": "2026-12-01T03:04:05Z",
                }
            ]
        }
    }


@pytest.mark.parametrize(
    ("card", "type_", "reason", "message"),
    [
        (
            make_card(5, False, detail="ecc"),
            "Warning",
            "XpuUnhealthy",
            "node n1: xpu5 (GPU-5) Unhealthy: ecc",
        ),
        (make_card(5, False, True, "q"), "Warning", "XpuQuarantined", "node n1: xpu5 (GPU-5) quarantined: q"),
        (
            make_card(5, detail="recovered"),
            "Normal",
            "XpuHealthy",
            "node n1: xpu5 (GPU-5) Healthy: recovered",
        ),
    ],
)
def test_event_on_the_pod_names_node_and_card(
    card: CardStatus, type_: str, reason: str, message: str
) -> None:
    assert build_event(PodRef("ml", "a"), "uid-1", card, "n1", NOW) == {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": "a.", "namespace": "ml"},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": "ml", "name": "a", "uid": "uid-1"},
        "type": type_,
        "reason": reason,
        "message": message,
        "source": {"component": "kunlun-device-plugin", "host": "n1"},
        "reportingComponent": "kunlun-device-plugin",
        "reportingInstance": "n1",
        "firstTimestamp": "2026-12-01T03:04:05Z",
        "lastTimestamp": "2026-12-01T03:04:05Z",
        "count": 1,
    }


# --- quarantine -----------------------------------------------------------------------------------


def test_third_failure_within_the_window_quarantines() -> None:
    window = FailureWindow(QuarantinePolicy(max_failures=3, window_seconds=600))
    assert [window.record("GPU-5", t) for t in (0, 100, 599)] == [False, False, True]


def test_failures_older_than_the_window_do_not_count() -> None:
    window = FailureWindow(QuarantinePolicy(max_failures=3, window_seconds=600))
    assert [window.record("GPU-5", t) for t in (0, 100, 650, 699)] == [False, False, False, True]
    assert window.count("GPU-5") == 3  # 100, 650, 699
    assert window.record("GPU-4", 702) is False  # counted per card


def test_forget_starts_counting_afresh() -> None:
    window = FailureWindow(QuarantinePolicy(max_failures=2, window_seconds=600))
    window.record("GPU-5", 0)
    window.forget("GPU-5")
    assert window.record("GPU-5", 1) is False


@pytest.mark.parametrize(
    ("failures", "window", "field"),
    [(0, 600, "--quarantine-failures"), (3, 0, "--quarantine-window-seconds")],
)
def test_bad_policy_names_the_flag(failures: int, window: float, field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        QuarantinePolicy(failures, window)
    assert caught.value.field == field


def test_annotation_round_trip() -> None:
    assert parse_quarantine(None) == frozenset()
    assert parse_quarantine(" GPU-5, ,GPU-1") == {"GPU-1", "GPU-5"}
    assert format_quarantine(frozenset({"GPU-5", "GPU-1"})) == "GPU-1,GPU-5"
    assert format_quarantine(frozenset()) is None  # removes the annotation


def test_annotation_entries_that_are_no_card_uuids_are_named() -> None:
    assert invalid_quarantine_entries("GPU-1 GPU-2,GPU-3") == ["GPU-1 GPU-2"]
    assert invalid_quarantine_entries("GPU-1,GPU-3") == []
    assert invalid_quarantine_entries(None) == []


# --- taint ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("healthy", "needed"),
    [([False] * 8, True), ([False] * 7 + [True], False), ([True] * 8, False), ([], False)],
)
def test_taint_needed_only_when_every_card_is_unhealthy(healthy: list[bool], needed: bool) -> None:
    assert taint_needed(healthy) is needed


def test_taint_list_keeps_the_taints_of_others() -> None:
    other = {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}
    assert build_taints([other], needed=True) == [other, OURS]
    assert build_taints([other, OURS], needed=True) is None  # already right
    assert build_taints([OURS, other], needed=False) == [other]
    assert build_taints([other], needed=False) is None

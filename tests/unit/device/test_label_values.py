"""Label values: label-safe, complete, and patches that touch only what differs."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kunlun_device.labeler.values import build_labels, label_patch, label_safe
from kunlun_device.xpu import Versions
from tests.unit.device.hosts import make_source

VALID = re.compile(r"^([A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?)?$")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("P800 OAM", "P800-OAM"),
        ("5.0.21.26", "5.0.21.26"),
        ("  R200 (8GB)  ", "R200-8GB"),
        ("v1.2+build/7", "v1.2-build-7"),
        ("---", None),
        (None, None),
        ("x" * 70, "x" * 63),
        ("a" * 62 + ".b", "a" * 62),
    ],
)
def test_label_safe(text: str | None, expected: str | None) -> None:
    assert label_safe(text) == expected


@given(st.text())
def test_label_safe_always_valid(text: str) -> None:
    value = label_safe(text)
    assert value is None or (len(value) <= 63 and VALID.match(value))


def test_labels_of_p800_node() -> None:
    source = make_source("p800-8")
    devices = source.list_devices()
    assert build_labels(devices, source.versions(devices)) == {
        "kunlun.dev/xpu.present": "true",
        "kunlun.dev/xpu.product": "P800-OAM",
        "kunlun.dev/xpu.count": "8",
        "kunlun.dev/xpu.driver-version": "5.0.21.26",
        "kunlun.dev/xpu.firmware-version": "1.0.2.14.1.54",
        "kunlun.dev/xpu.kml-version": "3.2.0",
    }


def test_labels_of_node_without_cards_remove_versions() -> None:
    assert build_labels((), Versions("5.0.21.26", "5.0.21", None, "3.2.0")) == {
        "kunlun.dev/xpu.present": "false",
        "kunlun.dev/xpu.product": None,
        "kunlun.dev/xpu.count": "0",
        "kunlun.dev/xpu.driver-version": None,
        "kunlun.dev/xpu.firmware-version": None,
        "kunlun.dev/xpu.kml-version": None,
    }


def test_patch_contains_only_differences_of_owned_labels() -> None:
    count, kml, present = "kunlun.dev/xpu.count", "kunlun.dev/xpu.kml-version", "kunlun.dev/xpu.present"
    current = {"kubernetes.io/hostname": "n1", count: "8", kml: "3.1"}
    desired = {count: "8", kml: None, present: "true"}
    assert label_patch(current, desired) == {kml: None, present: "true"}
    assert label_patch({present: "true"}, {present: "true"}) == {}

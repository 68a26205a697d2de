"""The drift test and the merge patch that removes what the operator no longer wants."""

from __future__ import annotations

import json

from kunlun_operator import names
from kunlun_operator.shell.apply import (
    is_owned,
    is_subset,
    keep_live_fields,
    last_applied,
    removal_patch,
    with_last_applied,
)


def test_server_defaults_are_not_drift_but_changed_or_missing_values_are() -> None:
    desired = {"spec": {"replicas": 1, "ports": [{"name": "http", "port": 8000}]}}
    defaulted = {
        "spec": {
            "replicas": 1,
            "sessionAffinity": "None",
            "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
        }
    }
    assert is_subset(desired, defaulted)
    assert not is_subset(desired, {"spec": {"replicas": 2, "ports": [{"name": "http", "port": 8000}]}})
    assert not is_subset(desired, {"spec": {"replicas": 1, "ports": []}})
    assert not is_subset(desired, {"spec": {"replicas": 1, "ports": [{"name": "http", "port": 8000}, {}]}})
    assert not is_subset(desired, {"spec": {}})


def test_quantities_compare_by_value_only_under_requests_and_limits() -> None:
    desired = {"resources": {"requests": {"cpu": "1", "memory": "1Gi"}}, "image": "x:1"}
    assert is_subset(
        desired, {"resources": {"requests": {"cpu": "1000m", "memory": "1024Mi"}}, "image": "x:1"}
    )
    assert not is_subset(desired, {"resources": {"requests": {"cpu": "2", "memory": "1Gi"}}, "image": "x:1"})
    assert not is_subset({"image": "1"}, {"image": "1.0"})


def test_removal_patch_nulls_what_was_applied_before_and_is_no_longer_wanted() -> None:
    previous = {"metadata": {"annotations": {"a": "1"}}, "spec": {"affinity": {"x": 1}, "replicas": 2}}
    desired = {"metadata": {"labels": {"l": "v"}}, "spec": {"replicas": 3}}
    assert removal_patch(desired, previous) == {
        "metadata": {"labels": {"l": "v"}, "annotations": None},
        "spec": {"replicas": 3, "affinity": None},
    }


def test_last_applied_round_trips_through_the_annotation() -> None:
    desired = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s", "annotations": {"a": "b"}}}
    stamped = with_last_applied(desired)
    assert stamped["metadata"]["annotations"]["a"] == "b"
    assert last_applied(stamped) == desired
    assert json.loads(stamped["metadata"]["annotations"][names.ANNOTATION_LAST_APPLIED]) == desired
    assert desired["metadata"]["annotations"] == {"a": "b"}  # the input is not mutated
    assert last_applied({"metadata": {"annotations": {names.ANNOTATION_LAST_APPLIED: "{broken"}}}) is None


def test_ownership_by_uid_or_by_the_operator_labels_for_this_instance() -> None:
    by_uid = {"metadata": {"ownerReferences": [{"uid": "u1"}]}}
    by_labels = {
        "metadata": {"labels": {names.LABEL_MANAGED_BY: names.MANAGER, names.LABEL_INSTANCE: "qwen"}}
    }
    assert is_owned(by_uid, "qwen", "u1")
    assert is_owned(by_labels, "qwen", "u2")  # left by a deleted service of the same name: adopted
    assert not is_owned(by_labels, "other", "u2")
    assert not is_owned({"metadata": {"labels": {"app": "mine"}}}, "qwen", "u1")


def test_live_fields_keep_what_another_controller_set() -> None:
    desired = {"spec": {"replicas": 2, "template": {"x": 1}}}
    kept = keep_live_fields(desired, {"spec": {"replicas": 4, "template": {"x": 9}}}, (("spec", "replicas"),))
    assert kept == {"spec": {"replicas": 4, "template": {"x": 1}}}
    assert desired["spec"]["replicas"] == 2
    assert keep_live_fields(desired, {"spec": {}}, (("spec", "replicas"),)) == desired

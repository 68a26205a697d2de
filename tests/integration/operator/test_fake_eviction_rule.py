"""The fake API decides evictions by the API server's rule (``tests/support/kubeapi.py``)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.kubeapi import _eviction_charges

READY = {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
NOT_READY = {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}
NO_READY_CONDITION: dict[str, Any] = {"status": {}}


def make_pdb(policy: str | None, current: int, desired: int) -> dict[str, Any]:
    spec = {"unhealthyPodEvictionPolicy": policy} if policy else {}
    return {"spec": spec, "status": {"currentHealthy": current, "desiredHealthy": desired}}


@pytest.mark.parametrize(
    ("pod", "pdb", "charged"),
    [
        (READY, make_pdb("AlwaysAllow", 0, 0), True),  # a healthy pod always needs the budget
        (READY, make_pdb(None, 2, 1), True),
        (NOT_READY, make_pdb("AlwaysAllow", 0, 0), False),  # not healthy: goes whatever the budget
        (NO_READY_CONDITION, make_pdb("AlwaysAllow", 0, 1), False),
        (NOT_READY, make_pdb(None, 1, 1), False),  # IfHealthyBudget, the budget otherwise satisfied
        (NOT_READY, make_pdb("IfHealthyBudget", 0, 0), True),  # desiredHealthy 0: falls back (429 at 0)
        (NOT_READY, make_pdb(None, 0, 1), True),  # fewer healthy than desired: falls back
    ],
)
def test_an_eviction_is_charged_to_the_budget_by_the_api_servers_rule(
    pod: dict[str, Any], pdb: dict[str, Any], charged: bool
) -> None:
    assert _eviction_charges(pdb, pod) is charged

"""HA through kopf peering: of two replicas exactly one reconciles; the other takes over when it dies."""

from __future__ import annotations

import copy
from importlib import resources

import pytest
import yaml

from tests.integration.operator.conftest import Cluster, wait_for

pytestmark = pytest.mark.slow
SPEC = {
    "model": {"name": "qwen", "source": {"hostPath": {"path": "/data/qwen"}}},
    "versions": {"driver": "5.0.21.26", "firmware": "1.0.2.14.1.54", "kml": "3.2.0"},
}


def test_one_replica_reconciles_and_the_standby_takes_over(cluster: Cluster) -> None:
    cluster.add_node("xpu-1")
    cluster.custom.create_cluster_custom_object(
        "kopf.dev",
        "v1",
        "clusterkopfpeerings",
        {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "kunlun-operator"}},
    )
    peering = ["--peering", "kunlun-operator", "--peering-lifetime", "3"]
    active = cluster.start_operator(*peering, "--priority", "200", standalone=False)
    # Start the standby once the active replica runs: two replicas starting in the same instant can
    # each miss the other's peering record for a moment (seen once in CI) and both reconcile.
    wait_for(lambda: "Resuming operations" in active.log(), message="the active replica to run")
    standby = cluster.start_operator(*peering, "--priority", "100", standalone=False)
    # With peering, kopf starts every replica paused until it has seen the peers.
    cluster.create_service(copy.deepcopy(SPEC))
    wait_for(lambda: cluster.status().get("phase"), message="the status")
    # The status can land before the replica's log line does: poll the log, then check the standby.
    wait_for(lambda: "reconciled ml/qwen" in active.log(), message="the active replica's reconcile")
    assert "reconciled ml/qwen" not in standby.log()

    active.kill()
    cluster.patch_service({"spec": {"runtime": {"maxModelLen": 2048}}})
    wait_for(lambda: cluster.status().get("observedGeneration") == 2, message="the standby to take over")
    assert "Resuming operations after the pause" in standby.log()
    # The pass logs its summary after writing the status: wait for the line, do not race it.
    wait_for(lambda: "reconciled ml/qwen generation 2" in standby.log(), message="the standby's reconcile")
    assert len(cluster.kube.objects("deployments", "apps")) == 1
    # The peering calls are the ones documented for it (api_calls.yaml, rules marked `peering`).
    documented = {
        (rule["group"], resource, verb)
        for rule in yaml.safe_load(resources.files("kunlun_operator").joinpath("api_calls.yaml").read_text())
        if rule.get("peering")
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    peering_calls = {(g, r, v) for v, g, r, _ in cluster.kube.calls() if g == "kopf.dev"}
    test_calls = {("kopf.dev", "clusterkopfpeerings", "create")}  # the test made the object
    assert peering_calls - test_calls <= documented and peering_calls - test_calls

"""The DRA kubelet plugin over real unix sockets, this test playing kubelet, claims on the fake API."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import kubernetes
import pytest

from kunlun_device.api import pluginregistration_v1_pb2 as reg
from kunlun_device.dra.checkpoint import PreparedClaim, PreparedDevice, save_checkpoint
from tests.integration.device.fake_dra_kubelet import SERVICES, DraNode, random_uid, result, running_dra_node


@pytest.fixture
def node(tmp_path: Path) -> Iterator[DraNode]:
    with running_dra_node(tmp_path) as dra_node:
        yield dra_node


def cdi_id(uid: str, index: int) -> str:
    return f"kunlun.dev/xpu={uid}-xpu-{index}"


def node_spec(path: str) -> dict[str, str]:
    return {"path": path, "hostPath": path, "permissions": "rw"}


def test_registers_with_the_plugin_watcher(node: DraNode) -> None:
    info = node.kubelet.register()
    assert info == reg.PluginInfo(
        type="DRAPlugin",
        name="xpu.kunlun.dev",
        endpoint=str(node.root / "plugins" / "xpu.kunlun.dev" / "dra.sock"),
        supported_versions=["v1.DRAPlugin", "v1beta1.DRAPlugin"],
    )
    assert node.kubelet.service == "v1.DRAPlugin"
    assert node.server is not None and node.server.registration.notifications == [(True, "")]


@pytest.mark.parametrize("service", list(SERVICES))
def test_prepare_writes_a_cdi_spec_and_unprepare_removes_it(node: DraNode, service: str) -> None:
    node.kubelet.register()
    pb, _ = SERVICES[service]
    namespace, name, uid = node.make_claim("tp2", [result("xpu-5", "tp"), result("xpu-4", "tp")])
    response = node.kubelet.prepare([(namespace, name, uid)], service)
    expected = pb.NodePrepareResourcesResponse(
        claims={
            uid: pb.NodePrepareResourceResponse(
                devices=[
                    pb.Device(
                        request_names=["tp"],
                        pool_name="node-a",
                        device_name=f"xpu-{i}",
                        cdi_device_ids=[cdi_id(uid, i)],
                    )
                    for i in (4, 5)
                ]
            )
        }
    )
    assert response == expected
    spec_file = node.cdi_dir / f"kunlun.dev-xpu_{uid}.json"
    assert json.loads(spec_file.read_text()) == {
        "cdiVersion": "0.6.0",
        "kind": "kunlun.dev/xpu",
        "containerEdits": {"env": ["XPU_VISIBLE_DEVICES=4,5"], "deviceNodes": [node_spec("/dev/xpuctrl")]},
        "devices": [
            {"name": f"{uid}-xpu-{i}", "containerEdits": {"deviceNodes": [node_spec(f"/dev/xpu{i}")]}}
            for i in (4, 5)
        ],
    }
    assert node.server is not None
    reads = node.server.driver.claim_reads
    # idempotent: the same answer again, from the checkpoint, without reading the claim
    assert node.kubelet.prepare([(namespace, name, uid)], service) == expected
    assert node.server.driver.claim_reads == reads
    done = pb.NodeUnprepareResourcesResponse(claims={uid: pb.NodeUnprepareResourceResponse()})
    assert node.kubelet.unprepare([(namespace, name, uid)], service) == done
    assert not spec_file.exists()
    assert node.kubelet.unprepare([(namespace, name, uid)], service) == done  # again: still fine


def test_bad_claims_are_answered_claim_by_claim(node: DraNode) -> None:
    node.kubelet.register()
    good = node.make_claim("good", [result("xpu-1")])
    unknown = node.make_claim("unknown", [result("xpu-9")])
    foreign = node.make_claim("foreign", [result("gpu-0", driver="gpu.example.com")])
    elsewhere = node.make_claim("elsewhere", [result("xpu-2", pool="node-b")])
    replaced = node.make_claim("replaced", [result("xpu-3")])
    missing = ("ml", "missing", random_uid())
    stale = (replaced[0], replaced[1], random_uid())
    response = node.kubelet.prepare([good, unknown, foreign, elsewhere, stale, missing])
    errors = {uid: entry.error for uid, entry in response.claims.items()}
    assert errors == {
        good[2]: "",
        unknown[2]: f"claim ml/unknown ({unknown[2]}): device xpu-9 does not exist on node node-a",
        foreign[2]: (
            f"claim ml/foreign ({foreign[2]}): no device of driver xpu.kunlun.dev allocated "
            "(drivers: gpu.example.com)"
        ),
        elsewhere[
            2
        ]: f"claim ml/elsewhere ({elsewhere[2]}): device xpu-2 is in pool 'node-b', not this node's 'node-a'",
        stale[2]: f"claim ml/replaced ({stale[2]}): metadata.uid is '{replaced[2]}' (the claim was replaced)",
        missing[2]: "claim ml/missing: cannot be read from the API: HTTP 404 Not Found",
    }
    assert [d.device_name for d in response.claims[good[2]].devices] == ["xpu-1"]
    assert sorted(p.name for p in node.cdi_dir.iterdir()) == [f"kunlun.dev-xpu_{good[2]}.json"]


def test_a_restart_mid_claim_neither_loses_nor_prepares_twice(node: DraNode) -> None:
    node.kubelet.register()
    claim = node.make_claim("tp4", [result(f"xpu-{i}") for i in range(4)])
    first = node.kubelet.prepare([claim])
    spec_file = node.cdi_dir / f"kunlun.dev-xpu_{claim[2]}.json"
    spec = spec_file.read_text()
    node.stop_plugin()
    checkpoint = json.loads((node.root / "plugins" / "xpu.kunlun.dev" / "checkpoint.json").read_text())
    assert list(checkpoint["claims"]) == [claim[2]]
    assert [d["deviceName"] for d in checkpoint["claims"][claim[2]]["devices"]] == [
        f"xpu-{i}" for i in range(4)
    ]
    # the claim is gone from the API: the restarted plugin can only answer from its checkpoint
    kubernetes.client.CustomObjectsApi(node.kube.client()).delete_namespaced_custom_object(
        "resource.k8s.io", "v1", claim[0], "resourceclaims", claim[1]
    )
    spec_file.unlink()  # and the runtime's CDI directory was wiped (a tmpfs after a reboot)
    restarted = node.start_plugin()
    node.kubelet.register()
    assert node.kubelet.prepare([claim]) == first
    assert restarted.driver.claim_reads == 0
    assert spec_file.read_text() == spec
    node.kubelet.unprepare([claim])
    assert not spec_file.exists()
    node.stop_plugin()
    assert (
        json.loads((node.root / "plugins" / "xpu.kunlun.dev" / "checkpoint.json").read_text())["claims"] == {}
    )


def test_a_checkpointed_card_gone_from_the_node_fails_that_claim_alone(node: DraNode) -> None:
    """A checkpoint from before the node lost a card (card 9 of a former 10-card node): preparing the
    claim again, with its CDI spec gone, names the claim and the card; the other claims are prepared."""
    node.stop_plugin()
    stale = ("ml", "old", random_uid())
    device = PreparedDevice(("xpus",), "node-a", "xpu-9", 9, (cdi_id(stale[2], 9),))
    save_checkpoint(
        node.root / "plugins" / "xpu.kunlun.dev" / "checkpoint.json",
        {stale[2]: PreparedClaim(stale[2], "ml", "old", (device,))},
    )
    node.start_plugin()
    node.kubelet.register()
    good = node.make_claim("good", [result("xpu-1")])
    response = node.kubelet.prepare([stale, good])
    assert {uid: entry.error for uid, entry in response.claims.items()} == {
        stale[2]: f"claim ml/old ({stale[2]}): checkpointed device xpu-9 no longer exists on this node",
        good[2]: "",
    }
    assert sorted(p.name for p in node.cdi_dir.iterdir()) == [f"kunlun.dev-xpu_{good[2]}.json"]

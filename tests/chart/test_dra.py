"""The chart's Dynamic Resource Allocation: per node pool the DaemonSet runs the classic plugin, the
DRA plugin (`kunlun-device-plugin dra`, with kubelet's plugin directories and the CDI directory) or
both; the DeviceClass selects our driver's devices; the ResourceSlice admission policy (evaluated with
`celpy` on the plugin's own slice) lets the DRA plugin write only its own node's pool."""

from __future__ import annotations

from typing import Any

import celpy
import pytest

from kunlun_device.dra.slices import build_resource_slice
from tests.chart.test_device_admission_policy import SA
from tests.chart.tools import Rendered, render
from tests.unit.device.hosts import make_source
from tests.unit.operator.dra_cel import selects

POOLS = {"devicePlugin": {"nodePools": {"dra": "dra", "mixed": "both"}}}


@pytest.fixture(scope="module")
def pools() -> Rendered:
    return render(overrides=POOLS)


def containers(rendered: Rendered, suffix: str) -> dict[str, dict[str, Any]]:
    pod = rendered.one("DaemonSet", suffix)["spec"]["template"]["spec"]
    return {c["name"]: c for c in pod["containers"]}


def pool_expressions(rendered: Rendered, suffix: str) -> list[dict[str, Any]]:
    affinity = rendered.one("DaemonSet", suffix)["spec"]["template"]["spec"]["affinity"]
    terms = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    return [e for t in terms for e in t["matchExpressions"] if e["key"] == "kunlun.dev/node-pool"]


def test_each_pool_gets_the_containers_of_its_allocation_on_its_own_nodes(pools: Rendered) -> None:
    assert list(containers(pools, "-device-plugin")) == ["plugin", "labeler", "exporter"]
    assert list(containers(pools, "-device-plugin-dra")) == ["dra", "labeler", "exporter"]
    assert list(containers(pools, "-device-plugin-mixed")) == ["plugin", "dra", "labeler", "exporter"]
    # two default affinity terms, each narrowed to the pool (or, for the default, to no pool)
    not_in = {"key": "kunlun.dev/node-pool", "operator": "NotIn", "values": ["dra", "mixed"]}
    assert pool_expressions(pools, "-device-plugin") == [not_in, not_in]
    assert (
        pool_expressions(pools, "-device-plugin-dra")
        == [{"key": "kunlun.dev/node-pool", "operator": "In", "values": ["dra"]}] * 2
    )


def test_the_dra_container_runs_the_dra_mode_with_kubelets_plugin_dirs_and_cdi(pools: Rendered) -> None:
    dra = containers(pools, "-device-plugin-dra")["dra"]
    assert dra["args"][0] == "dra"
    assert {
        "--plugins-dir=/var/lib/kubelet/plugins",
        "--registry-dir=/var/lib/kubelet/plugins_registry",
    } <= set(dra["args"])
    assert "--cdi-dir=/var/run/cdi" in dra["args"]
    mounts = {m["name"]: m["mountPath"] for m in dra["volumeMounts"]}
    assert mounts["kubelet-plugins-registry"] == "/var/lib/kubelet/plugins_registry"
    assert mounts["dra-plugin"] == "/var/lib/kubelet/plugins/xpu.kunlun.dev"
    assert mounts["cdi"] == "/var/run/cdi"
    volumes = {
        v["name"]: v
        for v in pools.one("DaemonSet", "-device-plugin-dra")["spec"]["template"]["spec"]["volumes"]
    }
    assert volumes["dra-plugin"]["hostPath"]["path"] == "/var/lib/kubelet/plugins/xpu.kunlun.dev"
    assert "device-plugins" not in volumes and "fault-state" not in volumes  # no classic plugin here


def test_a_non_default_kubelet_root_is_where_the_dra_plugin_serves_and_registers() -> None:
    # GetInfo hands kubelet the socket's path as the plugin sees it: it must be the host's path too
    hosts = {
        "kubeletPlugins": "/data/kubelet/plugins/",
        "kubeletPluginsRegistry": "/data/kubelet/plugins_registry",
    }
    rendered = render(overrides={"devicePlugin": {"nodePools": {"dra": "dra"}, "hostPaths": hosts}})
    pod = rendered.one("DaemonSet", "-device-plugin-dra")["spec"]["template"]["spec"]
    dra = next(c for c in pod["containers"] if c["name"] == "dra")
    assert {"--plugins-dir=/data/kubelet/plugins", "--registry-dir=/data/kubelet/plugins_registry"} <= set(
        dra["args"]
    )
    volumes = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    mounts = {m["name"]: m["mountPath"] for m in dra["volumeMounts"]}
    for name, path in (
        ("dra-plugin", "/data/kubelet/plugins/xpu.kunlun.dev"),
        ("kubelet-plugins-registry", "/data/kubelet/plugins_registry"),
    ):
        assert mounts[name] == volumes[name] == path


def test_without_a_dra_pool_nothing_of_dra_is_rendered() -> None:
    classic = render()
    assert not classic.all("DeviceClass")
    assert [d["metadata"]["name"] for d in classic.all("DaemonSet")] == ["kis-kunlun-inference-device-plugin"]
    assert "dra" not in containers(classic, "-device-plugin")


def test_the_device_class_selects_exactly_our_drivers_devices(pools: Rendered) -> None:
    (device_class,) = pools.all("DeviceClass")
    assert device_class["metadata"]["name"] == "xpu.kunlun.dev"
    (selector,) = device_class["spec"]["selectors"]
    device = published()["spec"]["devices"][0]
    assert selects(selector["cel"]["expression"], "xpu.kunlun.dev", device)
    assert not selects(selector["cel"]["expression"], "gpu.nvidia.com", device)


def published(node: str = "n1") -> dict[str, Any]:
    source = make_source("p800-8")
    devices = source.list_devices()
    return build_resource_slice(node, devices, source.versions(devices))


def slice_denials(policy: dict[str, Any], obj: dict[str, Any], node: str | None = "n1") -> list[str]:
    env = celpy.Environment()
    extra = {"authentication.kubernetes.io/node-name": [node]} if node else {}
    activation = {"request": {"userInfo": {"username": SA, "extra": extra}}, "object": obj}
    variables = {
        v["name"]: env.program(env.compile(v["expression"])).evaluate(celpy.json_to_cel(activation))
        for v in policy["spec"]["variables"]
    }
    cel = {k: celpy.json_to_cel(v) for k, v in activation.items()} | {
        "variables": celpy.json_to_cel(variables)
    }
    return [
        v["message"]
        for v in policy["spec"]["validations"]
        if not bool(env.program(env.compile(v["expression"])).evaluate(cel))
    ]


def test_the_slice_policy_lets_the_plugin_write_only_its_own_nodes_pool(pools: Rendered) -> None:
    policy = pools.one("ValidatingAdmissionPolicy", "-dra")
    assert policy["spec"]["matchConditions"][0]["expression"] == f"request.userInfo.username == '{SA}'"
    assert slice_denials(policy, published("n1")) == []
    own = "the DRA plugin may only write its own node's ResourceSlice (pool and nodeName its node)"
    assert slice_denials(policy, published("n2")) == [own]  # another node's slice
    assert slice_denials(policy, published("n1"), node=None) == [own]  # a token without a node
    foreign = published("n1")
    foreign["spec"]["driver"] = "gpu.nvidia.com"
    assert slice_denials(policy, foreign) == [
        "the DRA plugin may only publish devices of driver xpu.kunlun.dev"
    ]
    pool = published("n1")
    pool["spec"]["pool"]["name"] = "n2"
    assert slice_denials(policy, pool) == [own]

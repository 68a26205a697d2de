"""LoRA adapters in the operator: the spec and CRD, the pod (flags, volumes, the run-time list kept
out of the template), admission, memory feasibility, the per-pod plan and the status."""

from __future__ import annotations

from typing import Any

import pytest

from kunlun_operator.builders.adapters import LORA_WRAPPER, AdapterMount, adapter_volume_name
from kunlun_operator.builders.configmap import config_hash
from kunlun_operator.builders.deployment import build_deployment
from kunlun_operator.builders.leaderworkerset import build_leader_pod_spec, build_worker_pod_spec
from kunlun_operator.builders.pod_template import build_pod_spec
from kunlun_operator.decide.adapters import (
    AdapterAction,
    AdapterOutcome,
    AdapterPod,
    AdapterState,
    PodAdapters,
    ServedAdapter,
    adapter_pod,
    adapters_condition,
    parse_served,
    plan_pod,
)
from kunlun_operator.decide.reconcile import desired_objects, reconcile
from kunlun_operator.decide.status import Condition
from kunlun_operator.errors import SpecError
from kunlun_operator.policy.admission_policy import AdmissionPolicy, check_policy
from kunlun_operator.policy.feasibility import GiB, estimate_memory
from kunlun_operator.spec.service import parse_spec
from kunlun_operator.spec.values import InferenceSpec
from tests.unit.operator.crd_schema import validate_cr
from tests.unit.operator.factories import NOW, make_cr, make_facts, make_raw_spec, make_ref

IMAGE = "ghcr.io/kunlun-inference/kunlun-runtime:0.1.0"
SQL = {"name": "sql", "source": {"pvc": {"claimName": "adapters", "path": "sql"}}, "size": "80Mi"}
TONE = {"name": "tone", "source": {"pvc": {"claimName": "adapters", "path": "tone"}}, "size": "160Mi"}
HOST = {"name": "host", "source": {"hostPath": {"path": "/data/adapters/host"}}}
PACKED = {"name": "packed", "source": {"image": {"reference": "reg.io/adapters/packed:1"}}}


def _raw(adapters: list[dict[str, Any]], **lora: Any) -> dict[str, Any]:
    model = {"name": "qwen", "source": {"pvc": {"claimName": "models", "path": "Qwen2-7B"}}}
    return make_raw_spec(model={**model, "adapters": adapters}, runtime={"lora": lora} if lora else {})


def _spec(adapters: list[dict[str, Any]], **lora: Any) -> InferenceSpec:
    return parse_spec(_raw(adapters, **lora))


def _pod(spec: InferenceSpec, *, image_volumes: bool = False) -> dict[str, Any]:
    deployment = build_deployment(
        make_ref(), spec, image=IMAGE, config_hash="h", image_volumes=image_volumes, replicas=1
    )
    return deployment["spec"]["template"]["spec"]


def test_adapters_become_lora_flags_and_read_only_volumes_shared_per_claim() -> None:
    spec = _spec([SQL, TONE, HOST], maxLoras=2, maxLoraRank=64, maxCpuLoras=4)
    pvc, host = (
        adapter_volume_name(spec.model.adapters[0].source),
        adapter_volume_name(spec.model.adapters[2].source),
    )
    pod = _pod(spec)
    runtime = pod["containers"][0]
    assert runtime["command"] == ["kunlun-runtime"]
    assert runtime["args"][runtime["args"].index("--enable-lora") :] == [
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "64", "--max-cpu-loras", "4",
        "--lora-modules", f"sql=/adapters/{pvc}/sql", f"tone=/adapters/{pvc}/tone", f"host=/adapters/{host}",
    ]  # fmt: skip
    assert runtime["volumeMounts"][-2:] == [
        {"name": pvc, "mountPath": f"/adapters/{pvc}", "readOnly": True},
        {"name": host, "mountPath": f"/adapters/{host}", "readOnly": True},
    ]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[pvc] == {"name": pvc, "persistentVolumeClaim": {"claimName": "adapters", "readOnly": True}}
    assert volumes[host] == {"name": host, "hostPath": {"path": "/data/adapters/host", "type": "Directory"}}


def test_an_image_adapter_is_an_image_volume_or_fetched_like_an_image_model() -> None:
    spec = _spec([PACKED])
    volume = adapter_volume_name(spec.model.adapters[0].source)
    mounted = _pod(spec, image_volumes=True)
    assert {
        "name": volume,
        "image": {"reference": "reg.io/adapters/packed:1", "pullPolicy": "IfNotPresent"},
    } in (mounted["volumes"])
    assert f"packed=/adapters/{volume}/models" in mounted["containers"][0]["args"]
    fetched = _pod(spec, image_volumes=False)
    assert {"name": volume, "emptyDir": {}} in fetched["volumes"]
    assert f"packed=/adapters/{volume}" in fetched["containers"][0]["args"]
    fetch = next(c for c in fetched["initContainers"] if c["name"] == f"fetch-{volume}")
    assert (fetch["image"], fetch["command"], fetch["volumeMounts"]) == (
        "reg.io/adapters/packed:1",
        ["sh", "-c", "cp -R /models/. /model-fetch/"],
        [{"name": volume, "mountPath": "/model-fetch"}],
    )


def _workload(spec: InferenceSpec) -> tuple[dict[str, Any], dict[str, Any]]:
    objects, _ = desired_objects(make_ref(), spec, make_facts(), IMAGE, replicas=1)
    by_kind = {o["kind"]: o for o in objects}
    return by_kind["ConfigMap"], by_kind["Deployment"]


def test_with_runtime_updates_an_adapter_change_keeps_the_pod_template_and_moves_the_configmap_list() -> None:
    one = _spec([SQL], runtimeUpdates=True)
    two = _spec([SQL, TONE], runtimeUpdates=True)
    (config_one, deployment_one), (config_two, deployment_two) = _workload(one), _workload(two)
    assert deployment_one == deployment_two  # no rollout
    pvc = adapter_volume_name(one.model.adapters[0].source)
    assert config_two["data"]["lora-modules"] == (
        f"--lora-modules\nsql=/adapters/{pvc}/sql\ntone=/adapters/{pvc}/tone\n"
    )
    assert config_hash(config_one["data"]) == config_hash(config_two["data"])
    runtime = deployment_two["spec"]["template"]["spec"]["containers"][0]
    assert runtime["command"] == ["sh", "-c", LORA_WRAPPER, "kunlun-runtime"]
    assert "--allow-runtime-lora-updating" in runtime["args"] and "--lora-modules" not in runtime["args"]
    assert _workload(_spec([], runtimeUpdates=True))[0]["data"]["lora-modules"] == ""


def test_without_runtime_updates_an_adapter_change_rolls_the_pods() -> None:
    (config_one, deployment_one), (config_two, deployment_two) = (
        _workload(_spec([SQL])),
        _workload(_spec([SQL, TONE])),
    )
    assert config_hash(config_one["data"]) != config_hash(config_two["data"])
    assert deployment_one["spec"]["template"] != deployment_two["spec"]["template"]
    assert "lora-modules" not in config_two["data"]


@pytest.mark.parametrize(
    ("adapters", "lora", "field"),
    [
        ([SQL, {**TONE, "name": "sql"}], {}, "spec.model.adapters"),
        ([{**SQL, "name": "qwen"}], {}, "spec.model.adapters"),
        ([{**SQL, "name": "a,b"}], {}, "spec.model.adapters"),
        ([SQL], {"maxLoraRank": 513}, "spec.runtime.lora.maxLoraRank"),
        ([SQL], {"maxLoras": 0}, "spec.runtime.lora.maxLoras"),
        ([SQL], {"maxLoras": 4, "maxCpuLoras": 2}, "spec.runtime.lora.maxCpuLoras"),
        ([{"name": "x", "source": {}}], {}, "spec.model.adapters"),
        ([{**SQL, "source": {"pvc": {"claimName": "a", "path": "x\nname=/etc"}}}], {}, "spec.model.adapters"),
        ([{**HOST, "source": {"hostPath": {"path": "/data/a\tb"}}}], {}, "spec.model.adapters"),
    ],
    ids=[
        "duplicate",
        "model's name",
        "comma",
        "rank",
        "zero slots",
        "cpu below slots",
        "no source",
        "newline in a claim path",
        "tab in a host path",
    ],
)
def test_bad_adapters_are_refused_by_the_crd_and_the_operator_naming_the_field(
    adapters: list[dict[str, Any]], lora: dict[str, Any], field: str
) -> None:
    _, problems = validate_cr(make_cr(_raw(adapters, **lora)))
    assert problems and all(p.path.startswith(field) for p in problems)
    with pytest.raises(SpecError) as raised:
        parse_spec(_raw(adapters, **lora))
    assert raised.value.field.startswith(field)


def test_adapter_sources_are_under_the_model_sources_admission_policy() -> None:
    policy = AdmissionPolicy(host_paths=("/data/adapters",))
    assert check_policy(_spec([SQL, HOST]), policy) is None
    refused = check_policy(_spec([SQL, PACKED]), policy)
    assert refused is not None and refused.field == "spec.model.adapters[1].source.image.reference"
    outside = {"name": "x", "source": {"hostPath": {"path": "/etc/x"}}}
    refused = check_policy(_spec([outside]), policy)
    assert refused is not None and refused.field == "spec.model.adapters[0].source.hostPath.path"
    flag = parse_spec({**_raw([SQL]), "runtime": {"extraArgs": ["--lora-modules", "evil=/etc"]}})
    refused = check_policy(flag, policy)
    assert refused is not None and refused.field == "spec.runtime.extraArgs[0]"


def test_memory_counts_max_loras_slots_of_the_largest_declared_adapter() -> None:
    raw = _raw([SQL, TONE, HOST], maxLoras=4)
    raw["model"]["parameters"] = "7B"
    estimate = estimate_memory(parse_spec(raw), 64 * GiB)
    assert estimate is not None and estimate.adapters is not None
    assert estimate.required_bytes == 14 * 10**9 + 4 * 160 * 2**20
    assert "LoRA adapters 0.6 GiB (4 slot(s), 1 adapter(s) without size not counted)" in estimate.describe()
    plain = estimate_memory(
        parse_spec({**raw, "model": {**raw["model"], "adapters": []}, "runtime": {}}), 64 * GiB
    )
    assert plain is not None and plain.adapters is None and "LoRA" not in plain.describe()


def _mount(name: str, volume: str = "adapter-a") -> AdapterMount:
    return AdapterMount(name, f"/adapters/{volume}/{name}", volume)


def test_the_pod_plan_unloads_what_was_removed_loads_what_is_missing_and_replaces_what_moved() -> None:
    served = [
        ServedAdapter("old", "/adapters/adapter-a/old"),
        ServedAdapter("sql", "/adapters/adapter-a/sql"),
    ]
    served.append(ServedAdapter("tone", "/adapters/adapter-a/tone-v1"))
    desired = [_mount("sql"), _mount("tone"), _mount("new"), _mount("far", volume="adapter-b")]
    plan = plan_pod(desired, served, frozenset({"adapter-a"}))
    assert plan.actions == (
        AdapterAction("unload", "old"),
        AdapterAction("load", "tone", "/adapters/adapter-a/tone", inplace=True),
        AdapterAction("load", "new", "/adapters/adapter-a/new"),
    )
    assert [(s.name, s.state) for s in plan.settled] == [("sql", "Loaded"), ("far", "Pending")]


def test_only_pods_whose_runtime_answers_are_called_on_their_own_http_port() -> None:
    ports = [{"name": "kv-events", "containerPort": 5557}, {"name": "http", "containerPort": 8123}]
    pod = {
        "metadata": {"name": "qwen-1", "uid": "u1"},
        "spec": {
            "containers": [{"name": "runtime", "ports": ports}],
            "volumes": [{"name": "model"}, {"name": "adapter-a"}],
        },
        "status": {"podIP": "10.0.0.7", "conditions": [{"type": "ContainersReady", "status": "True"}]},
    }
    assert adapter_pod(pod) == AdapterPod("qwen-1", "u1", "10.0.0.7", 8123, frozenset({"model", "adapter-a"}))
    assert adapter_pod({**pod, "status": {"podIP": "10.0.0.7", "conditions": []}}) is None
    # A multi-node group's worker: no HTTP port (only the leader serves the API), never called.
    worker = build_worker_pod_spec(
        build_pod_spec(make_ref(), _spec([SQL], runtimeUpdates=True), "img", image_volumes=False)
    )
    assert adapter_pod({**pod, "spec": worker}) is None
    leader = build_leader_pod_spec(
        build_pod_spec(make_ref(), _spec([SQL], runtimeUpdates=True), "img", image_volumes=False)
    )
    assert adapter_pod({**pod, "spec": leader}).port == 8000  # type: ignore[union-attr]


def test_an_answer_that_is_not_a_model_list_is_an_error_not_a_crash() -> None:
    for answer in ("<html>proxy</html>", ["x"], {"object": "list"}, {"data": "x"}):
        with pytest.raises(ValueError, match="not an OpenAI model list"):
            parse_served(answer)
    served = {"data": [{"id": "tiny"}, {"parent": "tiny"}, {"id": "sql", "parent": "tiny", "root": "/a"}]}
    assert parse_served(served) == (ServedAdapter("sql", "/a"),)


def test_adapters_ready_and_status_report_each_pod() -> None:
    spec = _spec([SQL, TONE], runtimeUpdates=True)
    failed = AdapterState("tone", "Failed", "400 bad")
    outcome = AdapterOutcome(
        (PodAdapters("qwen-1", (AdapterState("sql", "Loaded"), failed)),), recheck_after_seconds=30.0
    )
    plan = reconcile(make_ref(), spec, {}, make_facts(adapters=outcome), now=NOW)
    assert plan.status["adapters"] == [
        {
            "pod": "qwen-1",
            "adapters": [
                {"name": "sql", "state": "Loaded"},
                {"name": "tone", "state": "Failed", "message": "400 bad"},
            ],
        }
    ]
    condition = next(c for c in plan.status["conditions"] if c["type"] == "AdaptersReady")
    assert (condition["status"], condition["reason"], condition["message"]) == (
        "False",
        "AdapterLoadFailed",
        "qwen-1: tone: 400 bad",
    )
    assert ("Warning", "AdapterLoadFailed") in [(e.type, e.reason) for e in plan.events]
    assert plan.requeue_after_seconds == 30.0
    loaded = AdapterOutcome(
        (PodAdapters("qwen-1", (AdapterState("sql", "Loaded"), AdapterState("tone", "Loaded"))),)
    )
    assert adapters_condition(spec, loaded, 1) == Condition(
        "AdaptersReady", "True", "AdaptersLoaded", "2 adapter(s) loaded on 1 ready pod(s)"
    )
    assert adapters_condition(_spec([SQL]), None, 1) == Condition(
        "AdaptersReady", "True", "ReadAtStart", "1 adapter(s) read at start by every ready pod"
    )
    assert adapters_condition(parse_spec(make_raw_spec()), None, 1) is None

"""Multi-node services (``spec.runtime.pipelineParallelSize`` > 1): the LeaderWorkerSet, validated
against the real LWS CRD, what the other objects select, the plan with and without LWS, admission."""

from __future__ import annotations

import copy
import re
from typing import Any

import kubernetes_validate
import pytest

from kunlun_operator import names
from kunlun_operator.builders.hpa import build_hpa
from kunlun_operator.builders.leaderworkerset import (
    WORKER_STOP_SECONDS,
    build_leaderworkerset,
)
from kunlun_operator.builders.pdb import build_pdb
from kunlun_operator.builders.pod_template import build_pod_spec
from kunlun_operator.builders.service import build_service
from kunlun_operator.decide.admission import review
from kunlun_operator.decide.reconcile import desired_objects, reconcile
from kunlun_operator.decide.status import DeploymentFacts
from kunlun_operator.policy.feasibility import GiB, estimate_memory, startup_budget_seconds
from kunlun_operator.policy.matrix import load_default_matrix
from kunlun_operator.spec.operator_config import PreflightHost
from kunlun_operator.spec.service import ServiceRef, parse_spec, parse_spec_or_error
from tests.unit.operator.crd_schema import load_lws_crd, validate_cr
from tests.unit.operator.factories import NOW, load_example, make_facts, make_raw_spec, make_ref

IMAGE = "ghcr.io/kunlun-inference/kunlun-runtime:0.1.0"
LABELS = {
    "app.kubernetes.io/name": "kunlun-runtime",
    "app.kubernetes.io/instance": "qwen",
    "app.kubernetes.io/component": "inference",
    "app.kubernetes.io/part-of": "kunlun-inference",
    "app.kubernetes.io/managed-by": "kunlun-operator",
}
SELECTOR = {"app.kubernetes.io/name": "kunlun-runtime", "app.kubernetes.io/instance": "qwen"}
LEADERS = {**SELECTOR, "leaderworkerset.sigs.k8s.io/worker-index": "0"}
RENDEZVOUS = [
    "--nnodes",
    "2",
    "--node-rank",
    "$(LWS_WORKER_INDEX)",
    "--master-addr",
    "$(LWS_LEADER_ADDRESS)",
    "--master-port",
    "29500",
    "--leader-wait-timeout",
]


def make_multinode_spec(**overrides: Any) -> dict[str, Any]:
    """Two nodes of eight cards per replica (TP 8 × PP 2)."""
    raw = make_raw_spec(runtime={"tensorParallelSize": 8, "pipelineParallelSize": 2}, resources={"xpus": 8})
    raw.update(copy.deepcopy(overrides))
    return raw


def _lws(raw: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    return build_leaderworkerset(
        make_ref(), parse_spec(raw), image=IMAGE, config_hash="abc", image_volumes=False, replicas=3, **kwargs
    )


def _runtime(template: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in template["spec"]["containers"] if c["name"] == "runtime")


def test_leaderworkerset_groups_two_pods_built_from_the_deployments_pod() -> None:
    raw = make_multinode_spec()
    lws = _lws(raw)
    pod = build_pod_spec(make_ref(), parse_spec(raw), IMAGE, image_volumes=False)
    leader, worker = copy.deepcopy(pod), copy.deepcopy(pod)
    leader["containers"][0]["ports"].append({"name": "dist", "containerPort": 29500, "protocol": "TCP"})
    for key in ("ports", "startupProbe", "readinessProbe", "livenessProbe"):
        del worker["containers"][0][key]
    worker["containers"][0]["lifecycle"] = {"preStop": {"exec": {"command": ["sleep", "85"]}}}
    template_meta = {"labels": LABELS, "annotations": {"serving.kunlun.dev/config-hash": "abc"}}
    assert lws == {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": {
            "name": "qwen-lws",
            "namespace": "ml",
            "labels": LABELS,
            "ownerReferences": [
                {
                    "apiVersion": "serving.kunlun.dev/v1alpha1",
                    "kind": "KunlunInferenceService",
                    "name": "qwen",
                    "uid": "uid-1",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "replicas": 3,
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "leaderWorkerTemplate": {
                "size": 2,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": {"metadata": template_meta, "spec": leader},
                "workerTemplate": {"metadata": template_meta, "spec": worker},
            },
        },
    }
    assert WORKER_STOP_SECONDS == 85


def test_every_pod_of_a_group_runs_the_same_serve_command_with_the_rendezvous() -> None:
    lws = _lws(make_multinode_spec())
    templates = lws["spec"]["leaderWorkerTemplate"]
    leader, worker = _runtime(templates["leaderTemplate"]), _runtime(templates["workerTemplate"])
    assert (
        leader["args"]
        == worker["args"]
        == [
            "serve",
            "--model",
            "/models/Qwen2-7B",
            "--served-model-name",
            "qwen",
            "--port",
            "8000",
            "--dtype",
            "auto",
            "--tensor-parallel-size",
            "8",
            "--pipeline-parallel-size",
            "2",
            *RENDEZVOUS,
            leader["args"][-1],
        ]
    )
    # a worker waits for the leader's port as long as the leader's startup probe waits for its load
    # (the leader's pod may still be pulling its image or model): never less, within one period
    probe = leader["startupProbe"]
    budget_seconds = probe["periodSeconds"] * probe["failureThreshold"]
    assert budget_seconds - probe["periodSeconds"] < int(leader["args"][-1]) <= budget_seconds
    # the version lock, the preflight on the pod's own 8 cards and the resources: on every pod
    for template in (templates["leaderTemplate"], templates["workerTemplate"]):
        spec = template["spec"]
        assert [c["name"] for c in spec["initContainers"]] == ["preflight"]
        preflight = spec["initContainers"][0]["args"]
        assert preflight[preflight.index("--min-cards") + 1] == "8"
        assert _runtime(template)["resources"]["limits"][names.RESOURCE_NAME] == "8"
        terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert {e["key"] for e in terms["nodeSelectorTerms"][0]["matchExpressions"]} == {
            names.LABEL_DRIVER_VERSION,
            names.LABEL_FIRMWARE_VERSION,
            names.LABEL_KML_VERSION,
        }


def test_extra_args_come_after_the_rendezvous() -> None:
    lws = _lws(
        make_multinode_spec(
            runtime={"tensorParallelSize": 8, "pipelineParallelSize": 2, "extraArgs": ["--x"]}
        )
    )
    args = _runtime(lws["spec"]["leaderWorkerTemplate"]["workerTemplate"])["args"]
    assert args[-11:] == [*RENDEZVOUS, args[-2], "--x"]


def test_the_leaders_startup_probe_waits_for_the_whole_group() -> None:
    raw = make_multinode_spec(
        model={"name": "m", "source": {"hostPath": {"path": "/m"}}, "parameters": "70B"}
    )
    single = dict(raw, runtime={"tensorParallelSize": 8})
    assert startup_budget_seconds(parse_spec(single)) == 2908  # 300 s + 20 s per GiB of 130.4 GiB
    assert startup_budget_seconds(parse_spec(raw)) == 2908 + 180  # + the workers and the group preflight
    probe = _runtime(_lws(raw)["spec"]["leaderWorkerTemplate"]["leaderTemplate"])["startupProbe"]
    assert (probe["periodSeconds"], probe["failureThreshold"]) == (10, 309)


def _validate_lws(lws: dict[str, Any]) -> None:
    _, problems = validate_cr(lws, load_lws_crd())
    assert problems == []


def _variants() -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Multi-node specs that exercise every branch of the pod builder: (raw spec, builder kwargs)."""
    image = {"name": "m", "source": {"image": {"reference": "reg/m:1", "pullPolicy": "Always"}}}
    return {
        "example": (load_example("kis-multinode.yaml")["spec"], {}),
        "minimal": (make_multinode_spec(), {}),
        "image volume, xpu-smi, no health gate": (
            make_multinode_spec(model=image),
            {"image_volumes": True, "xpu_health_gate": False, "preflight_host": PreflightHost(xpu_smi="/x")},
        ),
        "model-fetch copy, Warn, autoscaling, secrets": (
            make_multinode_spec(
                model=image,
                versions={"driver": "1", "firmware": "2", "kml": "3", "policy": "Warn"},
                autoscaling={"enabled": True, "maxReplicas": 4},
                apiKeySecretRef={"name": "keys", "key": "api"},
                rollout={"maxSurge": "25%", "maxUnavailable": 1},
                scheduling={"tolerations": [{"key": "a", "operator": "Exists"}], "priorityClassName": "high"},
            ),
            {},
        ),
    }


@pytest.mark.parametrize("variant", list(_variants()))
def test_every_built_leaderworkerset_is_valid_for_the_real_lws_crd(variant: str) -> None:
    raw, kwargs = _variants()[variant]
    lws = build_leaderworkerset(
        make_ref(),
        parse_spec(raw),
        image=IMAGE,
        config_hash="abc",
        image_volumes=kwargs.pop("image_volumes", False),
        replicas=2,
        **kwargs,
    )
    _validate_lws(lws)


@pytest.mark.parametrize("k8s_version", ["1.28.0", "1.31.0"])
def test_both_pod_templates_are_valid_pod_templates_for_kubernetes(k8s_version: str) -> None:
    lws = _lws(load_example("kis-multinode.yaml")["spec"])
    for role in ("leaderTemplate", "workerTemplate"):
        template = lws["spec"]["leaderWorkerTemplate"][role]
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role.lower()}}
        kubernetes_validate.validate({**pod_template, "template": template}, k8s_version, strict=True)


def test_the_lws_schema_check_rejects_unknown_and_misplaced_fields() -> None:
    """The validator is strict, so a passing LeaderWorkerSet means something."""
    lws = _lws(make_multinode_spec())
    typo = copy.deepcopy(lws)
    typo["spec"]["leaderWorkerTemplate"]["groupSize"] = 2
    deep = copy.deepcopy(lws)
    _runtime(deep["spec"]["leaderWorkerTemplate"]["workerTemplate"])["probes"] = {}
    wrong = copy.deepcopy(lws)
    wrong["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Always"
    assert [p.path for p in validate_cr(typo, load_lws_crd())[1]] == ["spec.leaderWorkerTemplate"]
    assert [p.path for p in validate_cr(deep, load_lws_crd())[1]] == [
        "spec.leaderWorkerTemplate.workerTemplate.spec.containers.0"
    ]
    assert [p.path for p in validate_cr(wrong, load_lws_crd())[1]] == [
        "spec.leaderWorkerTemplate.restartPolicy"
    ]


def test_service_selects_leaders_and_the_hpa_scales_the_leaderworkerset() -> None:
    spec = parse_spec(make_multinode_spec(autoscaling={"enabled": True, "maxReplicas": 4}))
    assert build_service(make_ref(), spec)["spec"]["selector"] == LEADERS
    assert build_hpa(make_ref(), spec)["spec"]["scaleTargetRef"] == {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "name": "qwen-lws",
    }
    # one budget over every pod of every group: its selector matches leaders and workers alike
    selector = build_pdb(make_ref(), spec)["spec"]["selector"]["matchLabels"]
    lws = _lws(make_multinode_spec())
    for role in ("leaderTemplate", "workerTemplate"):
        labels = lws["spec"]["leaderWorkerTemplate"][role]["metadata"]["labels"]
        assert selector.items() <= labels.items()


def test_multi_node_plan_builds_a_leaderworkerset_and_removes_a_deployment() -> None:
    spec = parse_spec(make_multinode_spec(autoscaling={"enabled": True, "maxReplicas": 4}))
    objects, absent = desired_objects(
        make_ref(), spec, make_facts(leaderworkerset_served=True), IMAGE, replicas=1
    )
    assert [o["kind"] for o in objects] == [
        "ConfigMap",
        "Service",
        "LeaderWorkerSet",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
    ]
    assert absent == [names.DEPLOYMENT]
    assert "pipeline-parallel-size: 2" in objects[0]["data"]["config.yaml"]


def test_single_node_plan_is_unchanged_by_lws_except_removing_a_leftover() -> None:
    spec = parse_spec(make_raw_spec())
    without, absent_without = desired_objects(make_ref(), spec, make_facts(), IMAGE, replicas=1)
    served, absent_served = desired_objects(
        make_ref(), spec, make_facts(leaderworkerset_served=True), IMAGE, replicas=1
    )
    assert served == without
    assert "pipeline" not in without[0]["data"]["config.yaml"]
    assert absent_without == [names.HPA]
    assert absent_served == [names.LEADER_WORKER_SET, names.HPA]


def test_without_lws_a_multi_node_service_builds_nothing_and_says_to_install_it() -> None:
    plan = reconcile(make_ref(), parse_spec_or_error(make_multinode_spec()), None, make_facts(), now=NOW)
    assert (plan.apply, plan.delete, plan.requeue_after_seconds) == ((), (), 60.0)
    ready = next(c for c in plan.status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "LeaderWorkerSetNotInstalled")
    assert ready["message"] == (
        "spec.runtime.pipelineParallelSize: 2 nodes per replica need LeaderWorkerSet "
        "(leaderworkerset.x-k8s.io/v1), which this cluster does not serve: install LeaderWorkerSet "
        "(https://lws.sigs.k8s.io; with the kunlun-inference chart also set leaderWorkerSet.installed=true), "
        "or set pipelineParallelSize to 1"
    )
    assert plan.status["phase"] == "Failed"
    assert [(e.type, e.reason) for e in plan.events] == [("Warning", "LeaderWorkerSetNotInstalled")]


def test_with_lws_the_status_counts_groups_from_the_leaderworkerset() -> None:
    lws = {
        "metadata": {"generation": 2},
        "spec": {"replicas": 2},
        "status": {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2, "observedGeneration": 2},
    }
    facts = make_facts(leaderworkerset_served=True, deployment=DeploymentFacts.from_leaderworkerset(lws))
    plan = reconcile(make_ref(), parse_spec_or_error(make_multinode_spec(replicas=2)), None, facts, now=NOW)
    assert (plan.status["phase"], plan.status["ready"]) == ("Ready", "2/2")
    pending = reconcile(
        make_ref(),
        parse_spec_or_error(make_multinode_spec()),
        None,
        make_facts(leaderworkerset_served=True),
        now=NOW,
    )
    ready = next(c for c in pending.status["conditions"] if c["type"] == "Ready")
    assert (ready["reason"], ready["message"]) == (
        "LeaderWorkerSetNotCreated",
        "the runtime LeaderWorkerSet does not exist yet",
    )
    autoscaled = make_multinode_spec(autoscaling={"enabled": True, "maxReplicas": 4})
    plan = reconcile(
        make_ref(), parse_spec_or_error(autoscaled), None, make_facts(leaderworkerset_served=True), now=NOW
    )
    assert plan.live_fields == {"LeaderWorkerSet": (("spec", "replicas"),)}


def test_admission_rejects_multi_node_without_lws_naming_the_field() -> None:
    matrix = load_default_matrix()
    denied = review(parse_spec_or_error(make_multinode_spec()), matrix, IMAGE)
    assert denied.denial is not None
    assert (denied.denial.field, denied.denial.reason) == (
        "spec.runtime.pipelineParallelSize",
        "LeaderWorkerSetNotInstalled",
    )
    assert "install LeaderWorkerSet" in str(denied.denial)
    assert review(
        parse_spec_or_error(make_multinode_spec()), matrix, IMAGE, leaderworkerset_served=True
    ).allowed
    assert review(
        parse_spec_or_error(make_raw_spec()), matrix, IMAGE
    ).allowed  # single node: LWS is irrelevant


def test_memory_feasibility_counts_the_cards_of_every_node() -> None:
    model = {"name": "m", "source": {"pvc": {"claimName": "c"}}, "parameters": "70B"}
    one_node = make_raw_spec(model=model, resources={"xpus": 4, "xpuProduct": "R300"})
    two_nodes = make_raw_spec(
        model=model, resources={"xpus": 4, "xpuProduct": "R300"}, runtime={"pipelineParallelSize": 2}
    )
    matrix = load_default_matrix()
    denied = review(parse_spec_or_error(one_node), matrix, IMAGE)
    assert denied.denial is not None and denied.denial.reason == "InsufficientMemory"
    assert review(parse_spec_or_error(two_nodes), matrix, IMAGE, leaderworkerset_served=True).allowed
    estimate = estimate_memory(parse_spec(two_nodes), 32 * GiB)
    assert estimate is not None
    # weights / (T·P) per card: 130.4 GiB over 2 × 4 cards of 28.8 usable GiB each
    assert (estimate.num_xpus, estimate.num_nodes, estimate.available_bytes) == (
        8,
        2,
        int(8 * 32 * GiB * 0.9),
    )
    assert estimate.describe() == (
        "weights 130.4 GiB + KV cache not estimated (set model.architecture and runtime.maxModelLen) = "
        "130.4 GiB; available 230.4 GiB (90% of 2 nodes × 4 × 32 GiB)"
    )
    tight = make_raw_spec(
        model=model, resources={"xpus": 2, "xpuProduct": "R300"}, runtime={"pipelineParallelSize": 2}
    )
    message = str(review(parse_spec_or_error(tight), matrix, IMAGE, leaderworkerset_served=True).denial)
    assert "does not fit 2 nodes × 2 × R300" in message


def test_more_stages_than_layers_is_rejected_naming_the_field() -> None:
    arch = {"numLayers": 2, "numKVHeads": 1, "headDim": 8}
    raw = make_multinode_spec(
        model={"name": "m", "source": {"pvc": {"claimName": "c"}}, "architecture": arch},
        runtime={"pipelineParallelSize": 3},
        resources={"xpus": 1},
    )
    crd_problems = validate_cr(
        {
            "apiVersion": "serving.kunlun.dev/v1alpha1",
            "kind": "KunlunInferenceService",
            "metadata": {"name": "q"},
            "spec": raw,
        }
    )[1]
    assert [p.path for p in crd_problems] == ["spec.runtime.pipelineParallelSize"]
    with pytest.raises(ValueError, match=r"^spec.runtime.pipelineParallelSize: 3 stages exceed"):
        parse_spec(raw)


def _kubelet_expand(args: list[str], env: dict[str, str]) -> list[str]:
    """What kubelet does to ``$(VAR)`` in container arguments."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in args]


def test_the_runtime_cli_accepts_the_multi_node_command() -> None:
    """The contract with kunlun-runtime (its half of issue 19): the group's serve command parses."""
    from kunlun_runtime.commands import cli as runtime_cli  # here, not at the top: it imports torch

    parser = runtime_cli.build_parser()
    serve = next(sub for sub in _subparsers(parser) if sub.prog.endswith(" serve"))
    lws = _lws(load_example("kis-multinode.yaml")["spec"])
    worker_args = _runtime(lws["spec"]["leaderWorkerTemplate"]["workerTemplate"])["args"]
    flags = sorted({arg.split("=", 1)[0] for arg in worker_args if arg.startswith("--")})
    unknown = [flag for flag in flags if flag not in serve._option_string_actions]
    assert unknown == [], f"the operator passes flags kunlun-runtime serve does not have: {unknown}"
    env = {"LWS_WORKER_INDEX": "1", "LWS_LEADER_ADDRESS": "qwen-lws-0.qwen-lws.ml"}
    args = parser.parse_args(_kubelet_expand(worker_args, env))
    assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (8, 2)
    assert (args.nnodes, args.node_rank, args.master_addr, args.master_port) == (
        2,
        1,
        "qwen-lws-0.qwen-lws.ml",
        29500,
    )


def _subparsers(parser: Any) -> list[Any]:
    return [
        sub
        for action in parser._actions
        if hasattr(action, "choices") and isinstance(action.choices, dict)
        for sub in action.choices.values()
    ]


class ReadingClient:
    """Records which objects the controller reads; serves LeaderWorkerSet, holds nothing."""

    def __init__(self) -> None:
        self.reads: list[tuple[str, str]] = []

    def get(self, kind: names.Kind, namespace: str | None, name: str) -> dict[str, Any] | None:
        self.reads.append((kind.kind, name))
        return None

    def list(self, kind: names.Kind, namespace: str | None, *, label_selector: str) -> list[dict[str, Any]]:
        return []

    def served_plurals(self, group_version: str) -> frozenset[str]:
        return frozenset({names.LEADER_WORKER_SET.plural})


@pytest.mark.parametrize(
    ("raw", "reads"),
    [
        (make_multinode_spec(), [("LeaderWorkerSet", "qwen-lws"), ("PersistentVolumeClaim", "models")]),
        (make_raw_spec(), [("Deployment", "qwen"), ("PersistentVolumeClaim", "models")]),
        # Invalid (here: TP 3 does not divide 8 cards): its plan is Failed whatever the workload says.
        (
            make_multinode_spec(runtime={"pipelineParallelSize": 2, "tensorParallelSize": 3}),
            [("Deployment", "qwen")],
        ),
    ],
    ids=["multi-node", "single-node", "invalid"],
)
def test_the_controller_reads_the_workload_and_claim_the_parsed_spec_names(
    raw: dict[str, Any], reads: list[tuple[str, str]]
) -> None:
    from kunlun_operator.shell.controller import Controller, ControllerConfig
    from kunlun_operator.shell.metrics import OperatorMetrics

    client = ReadingClient()
    controller = Controller(client, ControllerConfig(), OperatorMetrics(), lambda *_: None)  # type: ignore[arg-type]
    facts = controller.read_facts(make_ref(), parse_spec_or_error(raw), ())
    assert client.reads == reads
    assert (facts.deployment, facts.pvc_exists) == (None, None if len(reads) == 1 else False)


def test_a_multi_node_service_needs_a_name_lws_accepts() -> None:
    """LWS names its headless Service after itself, so its name must be a DNS-1035 label."""
    matrix = load_default_matrix()
    dotted = ServiceRef(name="qwen2.5-7b", namespace="ml", uid="uid-1", generation=1)
    plan = reconcile(
        dotted,
        parse_spec_or_error(make_multinode_spec()),
        None,
        make_facts(leaderworkerset_served=True),
        now=NOW,
    )
    assert (plan.apply, plan.status["lastFailure"]["message"]) == (
        (),
        "metadata.name: a multi-node service's LeaderWorkerSet 'qwen2.5-7b-lws' must be a DNS-1035 label "
        "(at most 63 lower-case letters, digits and '-', starting with a letter): rename the service",
    )
    long_name = "a" * 60
    denied = review(
        parse_spec_or_error(make_multinode_spec()), matrix, IMAGE, leaderworkerset_served=True, name=long_name
    )
    assert denied.denial is not None and denied.denial.field == "metadata.name"
    assert review(
        parse_spec_or_error(make_multinode_spec()), matrix, IMAGE, leaderworkerset_served=True, name="qwen"
    ).allowed
    # a single-node service keeps any name the API server takes
    assert reconcile(dotted, parse_spec_or_error(make_raw_spec()), None, make_facts(), now=NOW).apply

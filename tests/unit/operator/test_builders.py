"""Every builder: whole-manifest equality, and validity against the real Kubernetes schemas."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kunlun_operator import names
from kunlun_operator.builders.configmap import build_configmap, config_hash, runtime_args
from kunlun_operator.builders.deployment import build_deployment
from kunlun_operator.builders.hpa import build_hpa, quantity
from kunlun_operator.builders.pdb import build_pdb
from kunlun_operator.builders.pod_template import build_affinity, build_pod_spec, model_path
from kunlun_operator.builders.prometheusrule import build_prometheusrule
from kunlun_operator.builders.service import build_service
from kunlun_operator.builders.servicemonitor import build_servicemonitor
from kunlun_operator.decide.reconcile import desired_objects
from kunlun_operator.decide.status import desired_replicas
from kunlun_operator.spec.operator_config import PreflightHost
from kunlun_operator.spec.service import parse_spec
from tests.unit.operator.crd_schema import load_lws_crd, validate_cr
from tests.unit.operator.factories import example_names, load_example, make_facts, make_raw_spec, make_ref

LABELS = {
    "app.kubernetes.io/name": "kunlun-runtime",
    "app.kubernetes.io/instance": "qwen",
    "app.kubernetes.io/component": "inference",
    "app.kubernetes.io/part-of": "kunlun-inference",
    "app.kubernetes.io/managed-by": "kunlun-operator",
}
SELECTOR = {"app.kubernetes.io/name": "kunlun-runtime", "app.kubernetes.io/instance": "qwen"}
OWNER = [
    {
        "apiVersion": "serving.kunlun.dev/v1alpha1",
        "kind": "KunlunInferenceService",
        "name": "qwen",
        "uid": "uid-1",
        "controller": True,
        "blockOwnerDeletion": True,
    }
]
IMAGE = "ghcr.io/kunlun-inference/kunlun-runtime:0.1.0"
PROBE = {"httpGet": {"path": "/health", "port": "http"}, "timeoutSeconds": 5}
RESTRICTED = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "readOnlyRootFilesystem": True,
}


def _meta(name: str = "qwen", **extra: Any) -> dict[str, Any]:
    return {"name": name, "namespace": "ml", "labels": LABELS, **extra, "ownerReferences": OWNER}


def test_deployment_of_the_minimal_spec_is_exactly_this() -> None:
    spec = parse_spec(make_raw_spec())
    lock = [
        {"key": "kunlun.dev/xpu.driver-version", "operator": "In", "values": ["5.0.21.26"]},
        {"key": "kunlun.dev/xpu.firmware-version", "operator": "In", "values": ["1.0.2.14.1.54"]},
        {"key": "kunlun.dev/xpu.kml-version", "operator": "In", "values": ["3.2.0"]},
    ]
    assert build_deployment(
        make_ref(), spec, image=IMAGE, config_hash="abc", image_volumes=False, replicas=1
    ) == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": SELECTOR},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "revisionHistoryLimit": 3,
            "progressDeadlineSeconds": 1200,
            "template": {
                "metadata": {"labels": LABELS, "annotations": {"serving.kunlun.dev/config-hash": "abc"}},
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": 1000,
                        "runAsGroup": 1000,
                        "fsGroup": 1000,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "terminationGracePeriodSeconds": 90,
                    "readinessGates": [{"conditionType": "kunlun.dev/xpu-healthy"}],
                    "nodeSelector": {"kunlun.dev/xpu.present": "true"},
                    "tolerations": [
                        {"key": "kunlunxin.com/xpu", "operator": "Exists", "effect": "NoSchedule"}
                    ],
                    "affinity": {
                        "nodeAffinity": {
                            "requiredDuringSchedulingIgnoredDuringExecution": {
                                "nodeSelectorTerms": [{"matchExpressions": lock}]
                            }
                        }
                    },
                    "initContainers": [
                        {
                            "name": "preflight",
                            "image": IMAGE,
                            "imagePullPolicy": "IfNotPresent",
                            "command": ["kunlun-runtime"],
                            "args": [
                                "preflight",
                                "--expect-driver",
                                "5.0.21.26",
                                "--expect-firmware",
                                "1.0.2.14.1.54",
                                "--expect-kml",
                                "3.2.0",
                                "--min-cards",
                                "1",
                                "--require-allocation",
                                "--dev-root",
                                "/",
                                "--kml-version-file",
                                "/run/kunlun-host/usr/local/xpu/kml/VERSION",
                            ],
                            "resources": {
                                "requests": {"kunlunxin.com/xpu": "1"},
                                "limits": {"kunlunxin.com/xpu": "1"},
                            },
                            "securityContext": RESTRICTED,
                            "volumeMounts": [
                                {
                                    "name": "host-kml-version",
                                    "mountPath": "/run/kunlun-host/usr/local/xpu/kml",
                                    "readOnly": True,
                                }
                            ],
                        }
                    ],
                    "containers": [
                        {
                            "name": "runtime",
                            "image": IMAGE,
                            "imagePullPolicy": "IfNotPresent",
                            "command": ["kunlun-runtime"],
                            "args": [
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
                                "1",
                            ],
                            "ports": [{"name": "http", "containerPort": 8000, "protocol": "TCP"}],
                            "env": [{"name": "HOME", "value": "/tmp"}],
                            "resources": {
                                "requests": {"kunlunxin.com/xpu": "1"},
                                "limits": {"kunlunxin.com/xpu": "1"},
                            },
                            "startupProbe": {**PROBE, "periodSeconds": 10, "failureThreshold": 90},
                            "readinessProbe": {**PROBE, "periodSeconds": 5, "failureThreshold": 3},
                            "livenessProbe": {**PROBE, "periodSeconds": 15, "failureThreshold": 4},
                            "lifecycle": {"preStop": {"exec": {"command": ["sleep", "15"]}}},
                            "securityContext": RESTRICTED,
                            "volumeMounts": [
                                {"name": "model", "mountPath": "/models", "readOnly": True},
                                {"name": "config", "mountPath": "/etc/kunlun-runtime", "readOnly": True},
                                {"name": "tmp", "mountPath": "/tmp"},
                                {"name": "shm", "mountPath": "/dev/shm"},
                            ],
                        }
                    ],
                    "volumes": [
                        {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
                        {"name": "config", "configMap": {"name": "qwen-config"}},
                        {"name": "tmp", "emptyDir": {}},
                        {"name": "shm", "emptyDir": {"medium": "Memory"}},
                        {
                            "name": "host-kml-version",
                            "hostPath": {"path": "/usr/local/xpu/kml", "type": ""},
                        },
                    ],
                },
            },
        },
    }


def test_warn_policy_has_no_affinity_and_no_preflight() -> None:
    spec = parse_spec(
        make_raw_spec(
            versions={"driver": "5.0.21.26", "firmware": "1.0.2.14.1.54", "kml": "3.2.0", "policy": "Warn"}
        )
    )
    deployment = build_deployment(
        make_ref(), spec, image=IMAGE, config_hash="abc", image_volumes=False, replicas=2
    )
    pod = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["replicas"] == 2
    assert "affinity" not in pod and "initContainers" not in pod


def test_preflight_mounts_the_nodes_kml_file_and_xpu_smi_read_only_and_passes_their_paths() -> None:
    spec = parse_spec(make_raw_spec(resources={"xpus": 4}))
    host = PreflightHost(kml_version_file="/opt/xpu/kml/VERSION", xpu_smi="/opt/xpu/bin/xpu-smi")
    pod = build_pod_spec(make_ref(), spec, IMAGE, image_volumes=False, preflight_host=host)
    [init] = pod["initContainers"]
    assert init["args"][init["args"].index("--min-cards") :] == [
        "--min-cards",
        "4",
        "--require-allocation",
        "--dev-root",
        "/",
        "--kml-version-file",
        "/run/kunlun-host/opt/xpu/kml/VERSION",
        "--xpu-smi",
        "/run/kunlun-host/bin/xpu-smi",
    ]
    # the same card count as the runtime: kubelet hands it the same devices and XPU_VISIBLE_DEVICES
    assert (
        init["resources"]
        == pod["containers"][0]["resources"]
        == {
            "requests": {"kunlunxin.com/xpu": "4"},
            "limits": {"kunlunxin.com/xpu": "4"},
        }
    )
    assert init["volumeMounts"] == [
        {"name": "host-kml-version", "mountPath": "/run/kunlun-host/opt/xpu/kml", "readOnly": True},
        {"name": "host-xpu-smi", "mountPath": "/run/kunlun-host/bin/xpu-smi", "readOnly": True},
    ]
    assert pod["volumes"][-2:] == [
        # the file's directory without a type check: a node without the file reaches preflight
        {"name": "host-kml-version", "hostPath": {"path": "/opt/xpu/kml", "type": ""}},
        {"name": "host-xpu-smi", "hostPath": {"path": "/opt/xpu/bin/xpu-smi", "type": "File"}},
    ]
    # the runtime container mounts none of the node's files
    assert {m["name"] for m in pod["containers"][0]["volumeMounts"]} == {"model", "config", "tmp", "shm"}


def test_without_a_node_xpu_smi_the_preflight_uses_the_images_own() -> None:
    pod = build_pod_spec(make_ref(), parse_spec(make_raw_spec()), IMAGE, image_volumes=False)
    [init] = pod["initContainers"]
    assert "--xpu-smi" not in init["args"]
    assert [m["name"] for m in init["volumeMounts"]] == ["host-kml-version"]
    assert [v["name"] for v in pod["volumes"] if "hostPath" in v] == ["host-kml-version"]


def test_without_host_mounts_a_strict_pod_has_no_host_path_and_reads_the_images_files() -> None:
    # What a namespace enforcing Pod Security "baseline" or "restricted" admits.
    pod = build_pod_spec(
        make_ref(),
        parse_spec(make_raw_spec()),
        IMAGE,
        image_volumes=False,
        preflight_host=PreflightHost(kml_version_file=None),
    )
    [init] = pod["initContainers"]
    assert "--kml-version-file" not in init["args"] and "--xpu-smi" not in init["args"]
    assert "volumeMounts" not in init
    assert init["resources"]["limits"] == {"kunlunxin.com/xpu": "1"}  # the cards still come from kubelet
    assert not [v for v in pod["volumes"] if "hostPath" in v]


def test_no_host_files_are_mounted_without_the_strict_preflight() -> None:
    for policy in ("Warn", "Off"):
        versions = {"driver": "5.0.21.26", "firmware": "1.0.2.14.1.54", "kml": "3.2.0", "policy": policy}
        pod = build_pod_spec(
            make_ref(),
            parse_spec(make_raw_spec(versions=versions)),
            IMAGE,
            image_volumes=False,
            preflight_host=PreflightHost(xpu_smi="/usr/bin/xpu-smi"),
        )
        assert "initContainers" not in pod
        assert not [v for v in pod["volumes"] if "hostPath" in v]


def test_the_default_kml_file_is_the_one_the_labeler_reads() -> None:
    from kunlun_device.xpu import DEFAULT_KML_VERSION_FILE

    assert PreflightHost().kml_version_file == names.HOST_KML_VERSION_FILE == DEFAULT_KML_VERSION_FILE


def test_version_lock_is_anded_into_every_user_node_selector_term() -> None:
    user = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]},
                ]
            }
        },
        "podAntiAffinity": {"x": 1},
    }
    spec = parse_spec(make_raw_spec(scheduling={"affinity": user}))
    terms = build_affinity(spec)["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert [[e["key"] for e in t["matchExpressions"]] for t in terms] == [
        ["zone", names.LABEL_DRIVER_VERSION, names.LABEL_FIRMWARE_VERSION, names.LABEL_KML_VERSION],
        [names.LABEL_DRIVER_VERSION, names.LABEL_FIRMWARE_VERSION, names.LABEL_KML_VERSION],
    ]
    assert terms[1]["matchFields"] == [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]
    assert build_affinity(spec)["podAntiAffinity"] == {"x": 1}
    assert spec.scheduling.affinity == user  # the spec is not mutated


def test_runtime_args_map_every_engine_knob_to_its_vllm_flag() -> None:
    spec = parse_spec(
        make_raw_spec(
            runtime={
                "dtype": "bfloat16",
                "quantization": "int8",
                "maxModelLen": 4096,
                "maxNumSeqs": 32,
                "maxNumBatchedTokens": 8192,
                "blockSize": 32,
                "kvCacheMemory": "2Gi",
                "tensorParallelSize": 2,
                "enablePrefixCaching": False,
                "extraArgs": ["--seed=1"],
            },
            resources={"xpus": 2},
        )
    )
    assert runtime_args(spec, "/models/m") == [
        "serve",
        "--model",
        "/models/m",
        "--served-model-name",
        "qwen",
        "--port",
        "8000",
        "--dtype",
        "bfloat16",
        "--tensor-parallel-size",
        "2",
        "--quantization",
        "int8",
        "--max-model-len",
        "4096",
        "--max-num-seqs",
        "32",
        "--max-num-batched-tokens",
        "8192",
        "--block-size",
        "32",
        "--kv-cache-memory",
        str(2 * 2**30),
        "--no-enable-prefix-caching",
        "--seed=1",
    ]


def test_the_card_health_readiness_gate_can_be_turned_off_where_no_node_agent_sets_it() -> None:
    spec = parse_spec(make_raw_spec())
    objects, _ = desired_objects(make_ref(), spec, make_facts(xpu_health_gate=False), IMAGE, replicas=1)
    [deployment] = [o for o in objects if o["kind"] == "Deployment"]
    assert "readinessGates" not in deployment["spec"]["template"]["spec"]


def test_model_sources_mount_where_the_runtime_is_told_to_look() -> None:
    host = parse_spec(make_raw_spec(model={"name": "m", "source": {"hostPath": {"path": "/data/m"}}}))
    image = parse_spec(make_raw_spec(model={"name": "m", "source": {"image": {"reference": "reg/m:1"}}}))
    assert model_path(host, image_volumes=False) == "/models"
    assert model_path(image, image_volumes=True) == "/model-image/models"
    assert model_path(image, image_volumes=False) == "/models"
    fetch = build_deployment(make_ref(), image, image=IMAGE, config_hash="h", image_volumes=False, replicas=1)
    pod = fetch["spec"]["template"]["spec"]
    [fetcher] = [c for c in pod["initContainers"] if c["name"] == "model-fetch"]
    assert fetcher["image"] == "reg/m:1"
    # It copies the image's /models into the model volume, which it must mount elsewhere: a mount at
    # /models would hide the very files it copies (tests/images runs the copy for real).
    [fetch_mount] = fetcher["volumeMounts"]
    assert fetch_mount["name"] == "model" and not fetch_mount["mountPath"].startswith("/models")
    assert fetcher["command"] == ["sh", "-c", f"cp -R /models/. {fetch_mount['mountPath']}/"]
    [runtime] = [c for c in pod["containers"] if c["name"] == "runtime"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in runtime["volumeMounts"]
    assert pod["volumes"][0] == {"name": "model", "emptyDir": {}}
    mounted = build_deployment(
        make_ref(), image, image=IMAGE, config_hash="h", image_volumes=True, replicas=1
    )
    assert mounted["spec"]["template"]["spec"]["volumes"][0] == {
        "name": "model",
        "image": {"reference": "reg/m:1", "pullPolicy": "IfNotPresent"},
    }


def test_configmap_service_pdb_are_exactly_these() -> None:
    spec = parse_spec(make_raw_spec(service={"port": 80, "annotations": {"a": "b"}}))
    configmap = build_configmap(make_ref(), spec, "/models/Qwen2-7B")
    assert configmap == {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta("qwen-config"),
        "data": {
            "config.yaml": "model: /models/Qwen2-7B\nserved-model-name: qwen\nport: 8000\ndtype: auto\n"
            "tensor-parallel-size: 1\n"
        },
    }
    assert build_service(make_ref(), spec) == {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(annotations={"a": "b"}),
        "spec": {
            "type": "ClusterIP",
            "selector": SELECTOR,
            "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}],
        },
    }
    assert build_pdb(make_ref(), spec) == {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(),
        "spec": {
            "maxUnavailable": 1,
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
            "selector": {"matchLabels": SELECTOR},
        },
    }


def test_config_hash_changes_with_the_runtime_config_only() -> None:
    def hash_of(**overrides: Any) -> str:
        spec = parse_spec(make_raw_spec(**overrides))
        return config_hash(build_configmap(make_ref(), spec, model_path(spec, image_volumes=False))["data"])

    assert hash_of() == hash_of(replicas=5)
    assert hash_of() != hash_of(runtime={"maxModelLen": 2048})


def test_hpa_targets_the_deployment_on_the_chosen_vllm_metric() -> None:
    spec = parse_spec(
        make_raw_spec(
            autoscaling={"enabled": True, "minReplicas": 2, "maxReplicas": 6, "metric": "kvCacheUsage"}
        )
    )
    assert build_hpa(make_ref(), spec) == {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _meta(),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "qwen"},
            "minReplicas": 2,
            "maxReplicas": 6,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": "vllm:kv_cache_usage_perc"},
                        "target": {"type": "AverageValue", "averageValue": "800m"},
                    },
                }
            ],
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": 300}},
        },
    }
    assert [quantity(v) for v in (4, 4.0, 0.8, 2.5)] == ["4", "4", "800m", "2500m"]


def test_servicemonitor_and_prometheusrule() -> None:
    spec = parse_spec(make_raw_spec(monitoring={"interval": "15s", "labels": {"release": "prom"}}))
    labels = {**LABELS, "release": "prom"}
    assert build_servicemonitor(make_ref(), spec) == {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {**_meta(), "labels": labels},
        "spec": {
            "selector": {"matchLabels": SELECTOR},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": "15s"}],
        },
    }
    rule = build_prometheusrule(make_ref(), spec)
    assert rule["metadata"]["labels"] == labels
    group = rule["spec"]["groups"][0]
    assert group["name"] == "kunlun-inference.ml.qwen"
    assert [(r["alert"], r["expr"]) for r in group["rules"]] == [
        ("KunlunInferenceDown", 'absent(up{namespace="ml",service="qwen"} == 1)'),
        ("KunlunInferenceQueueBacklog", 'avg(vllm:num_requests_waiting{namespace="ml",service="qwen"}) > 8'),
        (
            "KunlunInferenceSlowFirstToken",
            "histogram_quantile(0.95, sum by (le) (rate("
            'vllm:time_to_first_token_seconds_bucket{namespace="ml",service="qwen"}[5m]))) > 5',
        ),
        ("KunlunInferenceKVCacheFull", 'max(vllm:kv_cache_usage_perc{namespace="ml",service="qwen"}) > 0.95'),
    ]


def _promtool() -> str | None:
    local = Path(__file__).resolve().parents[3] / ".tools" / "bin" / "promtool"
    return str(local) if local.exists() else shutil.which("promtool")


@pytest.mark.skipif(_promtool() is None, reason="promtool not fetched (scripts/fetch-tools.sh)")
def test_prometheusrule_passes_promtool(tmp_path: Path) -> None:
    spec = parse_spec(make_raw_spec())
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(build_prometheusrule(make_ref(), spec)["spec"]))
    result = subprocess.run(
        [_promtool(), "check", "rules", str(rules)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


BUILT_IN_KINDS = {"ConfigMap", "Service", "Deployment", "PodDisruptionBudget", "HorizontalPodAutoscaler"}


@pytest.mark.parametrize("k8s_version", ["1.28.0", "1.31.0"])
# kis-dra.yaml claims its cards through resource.k8s.io/v1 (Kubernetes >= 1.34): test_dra.py
# validates it for 1.34 and 1.37.
@pytest.mark.parametrize("example", [*(e for e in example_names() if e != "kis-dra.yaml"), "image-source"])
def test_every_built_object_is_valid_for_kubernetes(example: str, k8s_version: str) -> None:
    if example == "image-source":
        raw = make_raw_spec(
            model={"name": "m", "source": {"image": {"reference": "reg/m:1"}}},
            autoscaling={"enabled": True, "maxReplicas": 3},
        )
    else:
        raw = load_example(example)["spec"]
    # Image volumes exist from 1.31 on; older clusters get the copying init container. The node's
    # xpu-smi is mounted on the newer one, the image's is used on the older one.
    facts = make_facts(
        image_volumes=k8s_version >= "1.31",
        monitoring_plurals=frozenset(),
        preflight_host=PreflightHost(xpu_smi="/usr/local/bin/xpu-smi" if k8s_version >= "1.31" else None),
    )
    spec = parse_spec(raw)
    objects, _ = desired_objects(make_ref(), spec, facts, IMAGE, replicas=desired_replicas(spec, None))
    kinds = set()
    for obj in objects:
        if obj["kind"] == "LeaderWorkerSet":  # a multi-node example: its own CRD, pods as PodTemplates
            assert validate_cr(obj, load_lws_crd())[1] == []
            for role, template in obj["spec"]["leaderWorkerTemplate"].items():
                if role.endswith("Template"):
                    pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}}
                    kubernetes_validate.validate(
                        {**pod_template, "template": template}, k8s_version, strict=True
                    )
        else:
            kubernetes_validate.validate(obj, k8s_version, strict=True)
        kinds.add(obj["kind"])
    workload = "LeaderWorkerSet" if spec.multi_node else "Deployment"
    assert kinds <= BUILT_IN_KINDS | {workload}
    assert {"ConfigMap", "Service", workload, "PodDisruptionBudget"} <= kinds


def test_the_runtime_cli_accepts_every_command_the_operator_builds() -> None:
    """The contract with kunlun-runtime: its own parser takes our serve and preflight arguments."""
    from kunlun_runtime.commands import cli as runtime_cli  # here, not at the top: it imports torch

    parser = runtime_cli.build_parser()
    raws = [load_example(name)["spec"] for name in example_names()]
    raws = [raw for raw in raws if not parse_spec(raw).multi_node]  # test_leaderworkerset.py has those
    raws.append(
        make_raw_spec(runtime={"enablePrefixCaching": False, "kvCacheMemory": "2Gi", "blockSize": 32})
    )
    for raw in raws:
        objects = desired_objects(make_ref(), parse_spec(raw), make_facts(), IMAGE, replicas=1)[0]
        deployment = next(o for o in objects if o["kind"] == "Deployment")
        pod = deployment["spec"]["template"]["spec"]
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            if container["command"] == ["kunlun-runtime"]:
                args = parser.parse_args(container["args"])
                assert args.command == container["args"][0]
        serve = parser.parse_args(pod["containers"][0]["args"])
        assert (serve.port, serve.served_model_name) == (8000, raw["model"]["name"])


def test_the_operator_flags_name_the_preflights_host_files() -> None:
    from kunlun_operator.shell.cli import build_parser, parse_preflight_host

    def host(*flags: str) -> PreflightHost:
        return parse_preflight_host(build_parser().parse_args(["run", *flags]))

    assert host() == PreflightHost("/usr/local/xpu/kml/VERSION", None)
    assert host("--preflight-kml-version-file", "/opt/kml", "--preflight-xpu-smi", "/opt/xpu-smi") == (
        PreflightHost("/opt/kml", "/opt/xpu-smi")
    )
    with pytest.raises(SystemExit, match="--preflight-xpu-smi must be an absolute host path, got 'xpu-smi'"):
        host("--preflight-xpu-smi", "xpu-smi")
    with pytest.raises(SystemExit, match="--preflight-kml-version-file must be in a directory other than /"):
        host("--preflight-kml-version-file", "/VERSION")  # its directory would be the node's root
    for sneaky in ("/./VERSION", "//VERSION", "/etc/../VERSION", "/etc/kml/", "/etc//kml/VERSION"):
        # each would mount the node's root (or is no file): refused before normalising it away
        with pytest.raises(SystemExit, match=r"must be a normal absolute path .* got '"):
            host("--preflight-kml-version-file", sneaky)
    assert (
        host("--preflight-kml-version-file", "/etc/.kml/..VERSION").kml_version_file == "/etc/.kml/..VERSION"
    )
    # empty: no hostPath at all (Pod Security baseline/restricted namespaces refuse them)
    assert host("--preflight-kml-version-file", "") == PreflightHost(None, None)

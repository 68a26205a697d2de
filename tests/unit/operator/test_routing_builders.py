"""The routing objects of ``spec.routing.type: InferencePool``: whole manifests, validity against the
real InferencePool and HTTPRoute CRDs and the Kubernetes schemas, and the contract between the
runtime pods' KV events and the picker's indexer."""

from __future__ import annotations

import json
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kunlun_operator import names
from kunlun_operator.builders.httproute import build_httproute
from kunlun_operator.builders.inferencepool import build_inferencepool
from kunlun_operator.builders.picker_config import build_picker_configmap
from kunlun_operator.builders.picker_deployment import build_picker_deployment, picker_args
from kunlun_operator.builders.picker_rbac import build_picker_role, build_picker_rolebinding
from kunlun_operator.builders.picker_service import build_picker_service
from kunlun_operator.builders.picker_tokenizer import tokenizer_dir
from kunlun_operator.decide.reconcile import desired_objects
from kunlun_operator.decide.routing import routing_objects
from kunlun_operator.spec.operator_config import PickerImages
from kunlun_operator.spec.service import parse_spec
from kunlun_operator.spec.values import InferenceSpec
from tests.unit.operator.crd_schema import load_httproute_crd, load_inferencepool_crd, validate_cr
from tests.unit.operator.factories import OWNER, make_facts, make_raw_spec, make_ref

IMAGE = "ghcr.io/kunlun-inference/kunlun-runtime:0.1.0"
COMMON = {
    "app.kubernetes.io/name": "kunlun-runtime",
    "app.kubernetes.io/instance": "qwen",
    "app.kubernetes.io/component": "inference",
    "app.kubernetes.io/part-of": "kunlun-inference",
    "app.kubernetes.io/managed-by": "kunlun-operator",
}
PICKER_LABELS = {
    **COMMON,
    "app.kubernetes.io/name": "kunlun-endpoint-picker",
    "app.kubernetes.io/component": "endpoint-picker",
}
RUNTIME_PODS = {"app.kubernetes.io/name": "kunlun-runtime", "app.kubernetes.io/instance": "qwen"}
PICKER_PODS = {"app.kubernetes.io/name": "kunlun-endpoint-picker", "app.kubernetes.io/instance": "qwen"}
K8S_VERSIONS = ("1.28.0", "1.31.0")


def routed(**routing: Any) -> InferenceSpec:
    return parse_spec(make_raw_spec(routing={"type": "InferencePool", **routing}))


def _meta(name: str, labels: dict[str, str] = COMMON) -> dict[str, Any]:
    return {"name": name, "namespace": "ml", "labels": labels, "ownerReferences": OWNER}


def test_the_pool_selects_this_services_serving_pods_and_names_its_picker() -> None:
    pool = build_inferencepool(make_ref(), routed(picker={"failureMode": "FailClose"}))
    assert pool == {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": _meta("qwen"),
        "spec": {
            "selector": {"matchLabels": RUNTIME_PODS},
            "targetPorts": [{"number": 8000}],
            "appProtocol": "http",
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": "qwen-epp",
                "port": {"number": 9002},
                "failureMode": "FailClose",
            },
        },
    }
    assert validate_cr(pool, load_inferencepool_crd())[1] == []


def test_a_multi_node_pool_selects_the_group_leaders_only() -> None:
    raw = make_raw_spec(
        routing={"type": "InferencePool"},
        runtime={"tensorParallelSize": 8, "pipelineParallelSize": 2},
        resources={"xpus": 8},
    )
    pool = build_inferencepool(make_ref(), parse_spec(raw))
    leaders = {**RUNTIME_PODS, "leaderworkerset.sigs.k8s.io/worker-index": "0"}
    assert pool["spec"]["selector"] == {"matchLabels": leaders}
    assert validate_cr(pool, load_inferencepool_crd())[1] == []


def test_the_route_attaches_the_pool_to_the_named_gateway_listener() -> None:
    spec = routed(gateway={"name": "inference-gateway", "namespace": "gateways", "sectionName": "http"})
    route = build_httproute(make_ref(), spec)
    assert route == {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": _meta("qwen"),
        "spec": {
            "parentRefs": [
                {
                    "group": "gateway.networking.k8s.io",
                    "kind": "Gateway",
                    "name": "inference-gateway",
                    "namespace": "gateways",
                    "sectionName": "http",
                }
            ],
            "rules": [
                {
                    "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                    "backendRefs": [
                        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "qwen"}
                    ],
                    "timeouts": {"request": "0s"},
                }
            ],
        },
    }
    assert validate_cr(route, load_httproute_crd())[1] == []
    same_namespace = build_httproute(make_ref(), routed(gateway={"name": "gw"}))
    assert same_namespace["spec"]["parentRefs"] == [
        {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "gw"}
    ]
    assert validate_cr(same_namespace, load_httproute_crd())[1] == []


def test_the_picker_service_serves_ext_proc_and_metrics_from_the_picker_pods_only() -> None:
    """The picker serves ext-proc over TLS (secure serving, its default, is never turned off), so
    the port claims no cleartext protocol (no appProtocol, as the extension's chart)."""
    assert not any(a.startswith("--secure-serving") for a in picker_args(make_ref()))
    assert build_picker_service(make_ref()) == {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta("qwen-epp", PICKER_LABELS),
        "spec": {
            "type": "ClusterIP",
            "selector": PICKER_PODS,
            "ports": [
                {"name": "grpc-ext-proc", "port": 9002, "targetPort": "grpc", "protocol": "TCP"},
                {"name": "http-metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"},
            ],
        },
    }


def test_the_picker_reads_pods_pools_and_objectives_in_its_namespace_and_nothing_else() -> None:
    read = ["get", "list", "watch"]
    assert build_picker_role(make_ref())["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": read},
        {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"], "verbs": read},
        {
            "apiGroups": ["inference.networking.x-k8s.io"],
            "resources": ["inferenceobjectives", "inferencemodelrewrites"],
            "verbs": read,
        },
    ]
    binding = build_picker_rolebinding(make_ref())
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "qwen-epp"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "qwen-epp", "namespace": "ml"}]


def test_the_picker_deployment_serves_its_pool_with_its_config() -> None:
    deployment = build_picker_deployment(
        make_ref(),
        routed(picker={"failureMode": "FailClose"}),
        image="epp:1",
        tokenizer_image="tok:1",
        config_hash="abc",
        image_volumes=False,
    )
    probe = {
        "grpc": {"port": 9003, "service": "envoy.service.ext_proc.v3.ExternalProcessor"},
        "failureThreshold": 3,
    }
    assert deployment == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta("qwen-epp", PICKER_LABELS),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": PICKER_PODS},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {
                    "labels": PICKER_LABELS,
                    "annotations": {"serving.kunlun.dev/config-hash": "abc"},
                },
                "spec": {
                    "serviceAccountName": "qwen-epp",
                    "automountServiceAccountToken": True,
                    "enableServiceLinks": False,
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": 65532,
                        "runAsGroup": 65532,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "terminationGracePeriodSeconds": 90,
                    "containers": [
                        {
                            "name": "epp",
                            "image": "epp:1",
                            "imagePullPolicy": "IfNotPresent",
                            "args": [
                                "--pool-name",
                                "qwen",
                                "--pool-namespace",
                                "ml",
                                "--pool-group",
                                "inference.networking.k8s.io",
                                "--grpc-port",
                                "9002",
                                "--grpc-health-port",
                                "9003",
                                "--metrics-port",
                                "9090",
                                "--config-file",
                                "/config/config.yaml",
                                "--zap-encoder",
                                "json",
                                "--metrics-endpoint-auth=false",
                                "--tracing=false",
                            ],
                            "ports": [
                                {"name": "grpc", "containerPort": 9002, "protocol": "TCP"},
                                {"name": "grpc-health", "containerPort": 9003, "protocol": "TCP"},
                                {"name": "metrics", "containerPort": 9090, "protocol": "TCP"},
                            ],
                            "env": [
                                {
                                    "name": "NAMESPACE",
                                    "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
                                },
                                {
                                    "name": "POD_NAME",
                                    "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                                },
                            ],
                            "resources": {
                                "requests": {"cpu": "500m", "memory": "512Mi"},
                                "limits": {"memory": "2Gi"},
                            },
                            "readinessProbe": {**probe, "periodSeconds": 5},
                            "livenessProbe": {**probe, "periodSeconds": 10},
                            "securityContext": {
                                "allowPrivilegeEscalation": False,
                                "capabilities": {"drop": ["ALL"]},
                                "readOnlyRootFilesystem": True,
                            },
                            "volumeMounts": [
                                {"name": "config", "mountPath": "/config", "readOnly": True},
                                {"name": "tmp", "mountPath": "/tmp"},
                            ],
                        }
                    ],
                    "volumes": [
                        {"name": "config", "configMap": {"name": "qwen-epp"}},
                        {"name": "tmp", "emptyDir": {}},
                    ],
                },
            },
        },
    }


def test_no_runtime_selector_matches_a_picker_pod_and_the_pool_matches_no_picker() -> None:
    spec = routed()
    objects, _ = desired_objects(make_ref(), spec, make_facts(inference_pool_served=True), IMAGE, replicas=1)
    by_name = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    picker_pod = by_name["Deployment", "qwen-epp"]["spec"]["template"]["metadata"]["labels"]
    runtime_pod = by_name["Deployment", "qwen"]["spec"]["template"]["metadata"]["labels"]
    runtime_selectors = [
        by_name["Service", "qwen"]["spec"]["selector"],
        by_name["PodDisruptionBudget", "qwen"]["spec"]["selector"]["matchLabels"],
        by_name["Deployment", "qwen"]["spec"]["selector"]["matchLabels"],
        by_name["InferencePool", "qwen"]["spec"]["selector"]["matchLabels"],
    ]
    for selector in runtime_selectors:
        assert selector.items() <= runtime_pod.items()
        assert not selector.items() <= picker_pod.items()
    picker_selectors = [
        by_name["Service", "qwen-epp"]["spec"]["selector"],
        by_name["Deployment", "qwen-epp"]["spec"]["selector"]["matchLabels"],
    ]
    for selector in picker_selectors:
        assert selector.items() <= picker_pod.items()
        assert not selector.items() <= runtime_pod.items()


def _picker_config(spec: InferenceSpec, tokenizer: str = "/models/Qwen2-7B") -> dict[str, Any]:
    configmap = build_picker_configmap(make_ref(), spec, tokenizer_dir=tokenizer)
    return yaml.safe_load(configmap["data"]["config.yaml"])


def test_the_approximate_picker_scores_queue_kv_cache_and_estimated_prefixes() -> None:
    metrics = {"type": "metrics-data-source", "parameters": {"scheme": "http", "path": "/metrics"}}
    assert _picker_config(
        parse_spec(make_raw_spec(routing={"type": "InferencePool"}, runtime={"blockSize": 32}))
    ) == {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [
            {"type": "queue-scorer"},
            {"type": "kv-cache-utilization-scorer"},
            {"type": "prefix-cache-scorer", "parameters": {"autoTune": True, "blockSizeTokens": 32}},
            {"type": "max-score-picker"},
            metrics,
            {"type": "core-metrics-extractor"},
        ],
        "dataLayer": {
            "sources": [
                {"pluginRef": "metrics-data-source", "extractors": [{"pluginRef": "core-metrics-extractor"}]}
            ]
        },
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": "queue-scorer", "weight": 2},
                    {"pluginRef": "kv-cache-utilization-scorer", "weight": 2},
                    {"pluginRef": "prefix-cache-scorer", "weight": 3},
                    {"pluginRef": "max-score-picker"},
                ],
            }
        ],
    }


def _runtime(spec: InferenceSpec, **facts: Any) -> dict[str, Any]:
    objects, _ = desired_objects(
        make_ref(), spec, make_facts(inference_pool_served=True, **facts), IMAGE, replicas=1
    )
    [runtime] = next(o for o in objects if o["metadata"]["name"] == "qwen" and o["kind"] == "Deployment")[
        "spec"
    ]["template"]["spec"]["containers"]
    return runtime


def test_precise_pods_publish_the_kv_events_the_pickers_indexer_reads() -> None:
    spec = routed(precise=True, hashSeed="1234")
    runtime = _runtime(spec)
    scorer = next(p for p in _picker_config(spec)["plugins"] if p["type"] == "precise-prefix-cache-scorer")
    params = scorer["parameters"]
    env = {e["name"]: e for e in runtime["env"]}
    # one hash root: the pods' PYTHONHASHSEED is the indexer's hashSeed
    assert env["PYTHONHASHSEED"] == {"name": "PYTHONHASHSEED", "value": "1234"}
    assert params["tokenProcessorConfig"] == {"blockSize": 16, "hashSeed": "1234"}
    # one block size: explicit on the pods (the runtime's default), the same in the indexer
    args = runtime["args"]
    assert args[args.index("--block-size") + 1] == "16"
    assert args[args.index("--prefix-caching-hash-algo") + 1] == "sha256_cbor"
    # one port: the pods publish on kv-events, the indexer subscribes to every pod of the pool there
    assert {"name": "kv-events", "containerPort": 5557, "protocol": "TCP"} in runtime["ports"]
    assert params["kvEventsConfig"] == {
        "topicFilter": "kv@",
        "discoverPods": True,
        "podDiscoveryConfig": {"socketPort": 5557},
    }
    events = json.loads(args[args.index("--kv-events-config") + 1])
    assert events == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
        "topic": "kv@$(POD_IP):8000@qwen",  # llm-d's indexer keys a pod as the IP:port it routes to
    }
    assert env["POD_IP"] == {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    # llm-d's release build tokenises only through its sidecar's socket (llm-d-kv-cache's uds config)
    assert params["indexerConfig"]["tokenizersPoolConfig"] == {
        "modelName": "qwen",
        "uds": {
            "socketFile": "/tmp/tokenizer/tokenizer-uds.socket",
            "modelTokenizerMap": {"qwen": "/models/Qwen2-7B"},
        },
    }


def test_approximate_and_service_routed_pods_publish_no_events() -> None:
    for spec in (routed(), parse_spec(make_raw_spec())):
        runtime = _runtime(spec)
        assert not [a for a in runtime["args"] if "kv-events" in a or "hash-algo" in a]
        assert [p["name"] for p in runtime["ports"]] == ["http"]
        assert "PYTHONHASHSEED" not in {e["name"] for e in runtime["env"]}


def test_only_the_leader_of_a_multi_node_group_publishes() -> None:
    raw = make_raw_spec(
        routing={"type": "InferencePool", "precise": True},
        runtime={"tensorParallelSize": 8, "pipelineParallelSize": 2},
        resources={"xpus": 8},
    )
    objects, _ = desired_objects(
        make_ref(),
        parse_spec(raw),
        make_facts(inference_pool_served=True, leaderworkerset_served=True),
        IMAGE,
        replicas=1,
    )
    lws = next(o for o in objects if o["kind"] == "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    leader = lws["leaderTemplate"]["spec"]["containers"][0]
    worker = lws["workerTemplate"]["spec"]["containers"][0]
    assert "--kv-events-config" in leader["args"] and "kv-events" in {p["name"] for p in leader["ports"]}
    assert "--kv-events-config" not in worker["args"] and "ports" not in worker
    assert worker["args"] == [
        a for a in leader["args"] if a != "--kv-events-config" and not a.startswith("{")
    ]


SOURCES = [
    ("pvc", {"pvc": {"claimName": "models", "path": "Qwen2-7B"}}, False, "/models/Qwen2-7B"),
    ("hostPath", {"hostPath": {"path": "/data/qwen"}}, False, "/models"),
    ("image volume", {"image": {"reference": "reg/qwen:1"}}, True, "/model-image/models"),
    ("image copy", {"image": {"reference": "reg/qwen:1"}}, False, "/tokenizer"),
]
OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HOME": "/tmp/hf",
    "USE_MODELSCOPE": "false",
}


@pytest.mark.parametrize(("what", "source", "image_volumes", "path"), SOURCES, ids=[s[0] for s in SOURCES])
def test_a_precise_picker_tokenises_through_its_sidecar_from_the_models_own_files(
    what: str, source: dict[str, Any], image_volumes: bool, path: str
) -> None:
    """llm-d's picker has no tokenizer of its own: the UDS tokenizer sidecar (the operator's image)
    shares the socket directory with it and loads the model's tokenizer files, never downloading."""
    raw = make_raw_spec(
        model={"name": "qwen", "source": source}, routing={"type": "InferencePool", "precise": True}
    )
    spec = parse_spec(raw)
    assert tokenizer_dir(spec, image_volumes=image_volumes) == path
    pod = build_picker_deployment(
        make_ref(), spec, image="epp", tokenizer_image="tok:1", config_hash="h", image_volumes=image_volumes
    )["spec"]["template"]["spec"]
    epp, sidecar = pod["containers"]
    assert (epp["name"], sidecar["name"], sidecar["image"]) == ("epp", "tokenizer", "tok:1")
    socket = {"name": "tokenizer-socket", "mountPath": "/tmp/tokenizer"}
    assert socket in epp["volumeMounts"] and socket in sidecar["volumeMounts"]
    assert {"name": "tokenizer-socket", "emptyDir": {}} in pod["volumes"]
    assert "model" not in {m["name"] for m in epp["volumeMounts"]}  # the picker reads no model file
    [mount] = [m for m in sidecar["volumeMounts"] if m["name"] == "model"]
    assert (path + "/").startswith(mount["mountPath"] + "/") and mount["readOnly"] is True
    env = {e["name"]: e["value"] for e in sidecar["env"]}
    assert OFFLINE.items() <= env.items()
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": 8082}
    [volume] = [v for v in pod["volumes"] if v["name"] == "model"]
    if what == "image copy":
        assert volume == {"name": "model", "emptyDir": {}}
        [fetch] = pod["initContainers"]
        assert (fetch["image"], fetch["command"]) == (
            "reg/qwen:1",
            ["cp", "/models/tokenizer.json", "/models/tokenizer_config.json", "/tokenizer/"],
        )
    else:
        assert "initContainers" not in pod
    if what == "hostPath":  # the directory exists on the Kunlun nodes only
        assert pod["nodeSelector"] == {"kunlun.dev/xpu.present": "true"}
    kubernetes_validate.validate(
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": pod}, "1.31.0", strict=True
    )


def test_an_approximate_picker_has_no_tokenizer_sidecar() -> None:
    pod = build_picker_deployment(
        make_ref(), routed(), image="epp", tokenizer_image="tok:1", config_hash="h", image_volumes=False
    )["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["epp"] and "initContainers" not in pod


@pytest.mark.parametrize("k8s_version", K8S_VERSIONS)
@pytest.mark.parametrize("precise", [False, True])
def test_every_routing_object_is_valid_for_kubernetes_or_its_crd(k8s_version: str, precise: bool) -> None:
    spec = routed(precise=precise, gateway={"name": "gw", "sectionName": "https"})
    objects = routing_objects(make_ref(), spec, images=PickerImages(), image_volumes=False)
    assert [o["kind"] for o in objects] == [
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "ConfigMap",
        "Deployment",
        "Service",
        "InferencePool",
        "HTTPRoute",
    ]
    for obj in objects:
        assert obj["metadata"]["ownerReferences"] == OWNER
        if obj["kind"] == "InferencePool":
            assert validate_cr(obj, load_inferencepool_crd())[1] == []
        elif obj["kind"] == "HTTPRoute":
            assert validate_cr(obj, load_httproute_crd())[1] == []
        else:
            kubernetes_validate.validate(obj, k8s_version, strict=True)
    images = [c["image"] for c in objects[4]["spec"]["template"]["spec"]["containers"]]
    assert images == (
        [names.DEFAULT_PRECISE_ENDPOINT_PICKER_IMAGE, names.DEFAULT_PRECISE_TOKENIZER_IMAGE]
        if precise
        else [names.DEFAULT_ENDPOINT_PICKER_IMAGE]
    )


def test_a_service_routed_by_its_service_has_no_routing_objects_and_removes_any() -> None:
    spec = parse_spec(make_raw_spec())
    without_api, absent = desired_objects(make_ref(), spec, make_facts(), IMAGE, replicas=1)
    assert absent == [names.HPA]  # as before routing existed: nothing is asked of the routing APIs
    with_api, absent = desired_objects(
        make_ref(), spec, make_facts(inference_pool_served=True, httproute_served=True), IMAGE, replicas=1
    )
    assert with_api == without_api
    assert absent == [names.HPA, *names.ROUTING_KINDS]
    # routed without a gateway: a route left from an earlier spec goes
    _, absent = desired_objects(
        make_ref(), routed(), make_facts(inference_pool_served=True, httproute_served=True), IMAGE, replicas=1
    )
    assert absent == [names.HPA, names.HTTP_ROUTE]


def test_the_runtime_accepts_the_kv_events_flags_the_operator_gives_it() -> None:
    """The contract with kunlun-runtime: its own parser and KV events config take our flags, and the
    kubelet's expansion of $(POD_IP) makes the topic llm-d's indexer reads."""
    from kunlun_runtime.commands import cli as runtime_cli  # here, not at the top: it imports torch
    from kunlun_runtime.config import parse_kv_events_config

    args = runtime_cli.build_parser().parse_args(_runtime(routed(precise=True))["args"])
    assert (args.prefix_caching_hash_algo, args.block_size) == ("sha256_cbor", 16)
    config = parse_kv_events_config(args.kv_events_config.replace("$(POD_IP)", "10.0.0.7"))
    assert config.publishes
    assert (config.endpoint, config.topic) == ("tcp://*:5557", "kv@10.0.0.7:8000@qwen")

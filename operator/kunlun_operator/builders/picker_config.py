"""The Endpoint Picker's plugin configuration (its ConfigMap): how it scores and picks a pod.

Owns: the ``EndpointPickerConfig`` (``inference.networking.x-k8s.io/v1alpha1``, the format of the
Gateway API Inference Extension's picker and of llm-d's, which is built on it) in the ConfigMap
``<name>-epp`` the picker reads with ``--config-file``. Both profiles read the model server
protocol's gauges from every pod's ``/metrics`` (queue depth, KV-cache use) and pick the pod with
the highest weighted score. Approximate: the extension's ``prefix-cache-scorer`` estimates each
pod's prefix cache from the picker's own routing history. Precise: llm-d's
``precise-prefix-cache-scorer`` indexes the pods' real caches from their KV events (``kv_events``:
the same port, block size and hash seed), tokenising prompts through its tokenizer sidecar
(``picker_tokenizer``: a Unix socket, the model's own tokenizer files).
Invariant: the data is a pure function of the spec, so its hash rolls the picker when it changes.
"""

from __future__ import annotations

from typing import Any

import yaml

from kunlun_operator import names
from kunlun_operator.builders.common import PICKER_LABELS, build_metadata, header
from kunlun_operator.builders.kv_events import block_size
from kunlun_operator.builders.picker_tokenizer import SOCKET_FILE
from kunlun_operator.spec.routing import hash_seed
from kunlun_operator.spec.service import ServiceRef
from kunlun_operator.spec.values import InferenceSpec

CONFIG_KEY = "config.yaml"
API_VERSION = f"{names.INFERENCE_X_GROUP}/v1alpha1"
#: Where the picker reads the model server protocol's metrics on every pod of the pool.
METRICS_SOURCE = {"type": "metrics-data-source", "parameters": {"scheme": "http", "path": names.METRICS_PATH}}
METRICS_EXTRACTOR = {"type": "core-metrics-extractor"}
PICKER = {"type": "max-score-picker"}
#: The extension's own default weights (its inferencepool chart): load twice, prefix three times.
APPROXIMATE_WEIGHTS = (("queue-scorer", 2), ("kv-cache-utilization-scorer", 2), ("prefix-cache-scorer", 3))
#: llm-d's precise profile: the real prefix cache first, load to break ties.
PRECISE_WEIGHTS = (
    ("precise-prefix-cache-scorer", 2),
    ("kv-cache-utilization-scorer", 1),
    ("queue-scorer", 1),
)


def _profile(weights: tuple[tuple[str, int], ...]) -> list[dict[str, Any]]:
    plugins: list[dict[str, Any]] = [{"pluginRef": ref, "weight": weight} for ref, weight in weights]
    return [{"name": "default", "plugins": [*plugins, {"pluginRef": PICKER["type"]}]}]


def _metrics_layer(*extra: dict[str, Any]) -> dict[str, Any]:
    source = {"pluginRef": METRICS_SOURCE["type"], "extractors": [{"pluginRef": METRICS_EXTRACTOR["type"]}]}
    return {"sources": [source, *extra]}


def approximate_config(spec: InferenceSpec) -> dict[str, Any]:
    """Scores from the pods' metrics and the picker's estimate of their prefix caches (blocks of the
    runtime's block size; ``autoTune`` sizes the estimate from ``vllm:cache_config_info``)."""
    prefix = {
        "type": "prefix-cache-scorer",
        "parameters": {"autoTune": True, "blockSizeTokens": block_size(spec)},
    }
    return {
        "apiVersion": API_VERSION,
        "kind": "EndpointPickerConfig",
        "plugins": [
            {"type": "queue-scorer"},
            {"type": "kv-cache-utilization-scorer"},
            prefix,
            dict(PICKER),
            METRICS_SOURCE,
            METRICS_EXTRACTOR,
        ],
        "dataLayer": _metrics_layer(),
        "schedulingProfiles": _profile(APPROXIMATE_WEIGHTS),
    }


def precise_config(ref: ServiceRef, spec: InferenceSpec, tokenizer_dir: str) -> dict[str, Any]:
    """Scores from the pods' metrics and an index of their prefix caches built from their KV events:
    the picker subscribes to every pod of the pool on the ``kv-events`` port (its endpoints come from
    the data layer's ``endpoint-notification-source``) and hashes prompts as the pods do.
    ``tokenizer_dir``: the directory of the model's tokenizer files inside the tokenizer sidecar,
    which the picker reaches on ``SOCKET_FILE`` (the only tokenizer of llm-d's release build)."""
    model = spec.model.name
    scorer = {
        "type": "precise-prefix-cache-scorer",
        "parameters": {
            "tokenProcessorConfig": {
                "blockSize": block_size(spec),
                "hashSeed": hash_seed(spec.routing, ref.namespace, ref.name),
            },
            "kvEventsConfig": {
                "topicFilter": "kv@",
                "discoverPods": True,
                "podDiscoveryConfig": {"socketPort": names.KV_EVENTS_PORT},
            },
            "indexerConfig": {
                "tokenizersPoolConfig": {
                    "modelName": model,
                    "uds": {"socketFile": SOCKET_FILE, "modelTokenizerMap": {model: tokenizer_dir}},
                },
                "kvBlockIndexConfig": {"enableMetrics": True},
            },
        },
    }
    notifications = {"type": "endpoint-notification-source"}
    return {
        "apiVersion": API_VERSION,
        "kind": "EndpointPickerConfig",
        "plugins": [
            notifications,
            METRICS_SOURCE,
            METRICS_EXTRACTOR,
            {"type": "single-profile-handler"},
            scorer,
            {"type": "kv-cache-utilization-scorer"},
            {"type": "queue-scorer"},
            dict(PICKER),
        ],
        "dataLayer": _metrics_layer(
            {"pluginRef": notifications["type"], "extractors": [{"pluginRef": scorer["type"]}]}
        ),
        "schedulingProfiles": _profile(PRECISE_WEIGHTS),
    }


def build_picker_configmap(ref: ServiceRef, spec: InferenceSpec, *, tokenizer_dir: str) -> dict[str, Any]:
    """The picker's ConfigMap; ``tokenizer_dir`` is used by the precise profile only."""
    config = precise_config(ref, spec, tokenizer_dir) if spec.routing.precise else approximate_config(spec)
    return {
        **header(names.PICKER_CONFIGMAP),
        "metadata": build_metadata(ref, names.PICKER_CONFIGMAP, labels=PICKER_LABELS),
        "data": {CONFIG_KEY: yaml.safe_dump(config, sort_keys=False)},
    }

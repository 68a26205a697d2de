"""Prometheus scrape configurations from ServiceMonitors, as the Prometheus Operator writes them.

Owns: turning one ServiceMonitor endpoint plus the target that Kubernetes service discovery would
find behind it (namespace, Service, pod, container, port name, address) into a plain
`scrape_configs` entry with static targets, so that a real Prometheus on loopback scrapes with the
same path, authorization, honorLabels and relabelings, and attaches the same target labels
(`namespace`, `service`, `pod`, `container`, `endpoint`, `job`) that alerts and dashboards join on.
Invariant: an endpoint field this module does not translate fails loudly (a new chart setting must
be translated here, never silently dropped); only the scrape interval is the test's own.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Endpoint fields translated below; `interval` is replaced by the test's interval.
TRANSLATED = frozenset(
    {
        "port",
        "path",
        "scheme",
        "params",
        "interval",
        "honorLabels",
        "authorization",
        "bearerTokenSecret",
        "relabelings",
        "metricRelabelings",
    }
)


@dataclass(frozen=True, slots=True)
class Target:
    """One scrape target as the Kubernetes service discovery of a ServiceMonitor sees it."""

    address: str  # host:port, here on loopback
    namespace: str
    service: str  # the Service the ServiceMonitor selected
    pod: str
    container: str  # the container that declares the port
    port_name: str  # the Service port the endpoint names (the `endpoint` label)


def snake_case(key: str) -> str:
    """`sourceLabels` → `source_labels` (the CRD's relabel fields in Prometheus's spelling)."""
    return re.sub(r"(?<!^)([A-Z])", r"_\1", key).lower()


def relabel_configs(relabelings: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """ServiceMonitor `relabelings` / `metricRelabelings` as Prometheus `relabel_configs`."""
    converted = []
    for rule in relabelings:
        entry = {snake_case(key): value for key, value in rule.items()}
        if "action" in entry:
            entry["action"] = str(entry["action"]).lower()  # the CRD also accepts e.g. "Replace"
        converted.append(entry)
    return converted


def bearer_file(secret_ref: Mapping[str, str], secrets: Mapping[tuple[str, str], Path]) -> str:
    """The file holding the Secret key `secret_ref` names (what the operator would mount)."""
    key = (secret_ref["name"], secret_ref["key"])
    assert key in secrets, f"the ServiceMonitor reads Secret {key}, which the test did not provide"
    return str(secrets[key])


def build_scrape_config(
    monitor: Mapping[str, Any],
    index: int,
    target: Target,
    *,
    interval: str,
    secrets: Mapping[tuple[str, str], Path] | None = None,
) -> dict[str, Any]:
    """The scrape config of endpoint `index` of ServiceMonitor `monitor` for `target`.

    Args:
        monitor: a rendered ServiceMonitor (`monitoring.coreos.com/v1`).
        index: which of its `spec.endpoints`.
        target: what service discovery would find; its `port_name` must be the endpoint's `port`.
        interval: the scrape interval to use instead of the endpoint's (tests run in seconds).
        secrets: (Secret name, key) → a file with its value, for bearer-token authorization.
    Raises:
        AssertionError: the endpoint uses a field not translated here, or names another port.
    """
    endpoint = monitor["spec"]["endpoints"][index]
    unknown = set(endpoint) - TRANSLATED
    assert not unknown, f"{monitor['metadata']['name']}: translate endpoint fields {sorted(unknown)}"
    assert endpoint["port"] == target.port_name, (endpoint["port"], target)
    job_label = monitor["spec"].get("jobLabel")
    assert job_label is None, "jobLabel (job from a Service label) is not translated"
    meta = monitor["metadata"]
    config: dict[str, Any] = {
        # The Prometheus Operator's job naming: serviceMonitor/<namespace>/<name>/<endpoint index>.
        "job_name": f"serviceMonitor/{meta['namespace']}/{meta['name']}/{index}",
        "scrape_interval": interval,
        "scrape_timeout": interval,
        "metrics_path": endpoint.get("path", "/metrics"),
        "scheme": endpoint.get("scheme", "http"),
        "honor_labels": bool(endpoint.get("honorLabels", False)),
        "static_configs": [
            {
                "targets": [target.address],
                # The labels the operator's generated relabelings attach; `job` is the Service name.
                "labels": {
                    "namespace": target.namespace,
                    "service": target.service,
                    "pod": target.pod,
                    "container": target.container,
                    "endpoint": target.port_name,
                    "job": target.service,
                },
            }
        ],
    }
    if "params" in endpoint:
        config["params"] = endpoint["params"]
    if "authorization" in endpoint:
        auth = endpoint["authorization"]
        config["authorization"] = {
            "type": auth.get("type", "Bearer"),
            "credentials_file": bearer_file(auth["credentials"], secrets or {}),
        }
    if "bearerTokenSecret" in endpoint:
        config["authorization"] = {
            "type": "Bearer",
            "credentials_file": bearer_file(endpoint["bearerTokenSecret"], secrets or {}),
        }
    if endpoint.get("relabelings"):
        config["relabel_configs"] = relabel_configs(endpoint["relabelings"])
    if endpoint.get("metricRelabelings"):
        config["metric_relabel_configs"] = relabel_configs(endpoint["metricRelabelings"])
    return config


def discovered(
    monitor: Mapping[str, Any],
    service: Mapping[str, Any],
    workload: Mapping[str, Any],
    pod: str,
    address: str,
) -> Target:
    """What service discovery finds behind `monitor`'s first endpoint: `service` must be selected
    by it, `workload`'s pods by the Service, and the port must be declared by one container."""
    namespaces = monitor["spec"].get("namespaceSelector", {}).get("matchNames") or [
        monitor["metadata"]["namespace"]
    ]
    assert service["metadata"]["namespace"] in namespaces, (namespaces, service["metadata"])
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items(), (selector, service["metadata"])
    pod_labels = workload["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items(), service["spec"]["selector"]
    port_name = monitor["spec"]["endpoints"][0]["port"]
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == port_name]
    containers = workload["spec"]["template"]["spec"]["containers"]
    (container,) = [c for c in containers if any(p["name"] == port["targetPort"] for p in c.get("ports", []))]
    namespace = service["metadata"]["namespace"]
    return Target(address, namespace, service["metadata"]["name"], pod, container["name"], port_name)

"""A real Prometheus checks the monitoring end to end, on loopback (issue 22).

Prometheus (Debian's package: `.tools/bin/prometheus`, from `make tools`) scrapes
- a live runtime (tiny random model, `--max-num-seqs 1`, a metrics token, speculative decoding as
  the operator's `--speculative-config`, one greedy request on a repeating prompt so that drafts
  were proposed) with the ServiceMonitor the operator builds for a KunlunInferenceService (bearer
  token from the same Secret the runtime reads), and
- the chip exporter, started with the chart's own exporter arguments (paths mapped) on the P800
  fixture host, with the chart's ServiceMonitor (`honorLabels`); a fake kubelet says the runtime
  pod holds cards 4 and 5,
and evaluates the chart's PrometheusRule groups. Then every series the dashboard and the alerts use
is in the scraped data, every rule evaluates cleanly, every dashboard query answers (the chip panels
join each held card to the model), KunlunRequestQueueGrowing fires from real waiting requests, and
the prometheus-adapter rule of docs/operator.md serves each metric the HPA can ask for.

The test's own settings, nothing else: scrape and evaluation every second, and that one alert's
`for:` shortened. The operator's series (`kunlun_operator_*`) are not scraped here: its labelled
counters appear with the first reconcile or replacement; test_metric_names checks them against the code.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import re
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import yaml

from kunlun_operator.builders.deployment import build_deployment
from kunlun_operator.builders.hpa import METRIC_NAMES
from kunlun_operator.builders.service import build_service
from kunlun_operator.builders.servicemonitor import build_servicemonitor
from kunlun_operator.spec.service import ServiceRef, parse_spec
from tests.chart.monitored_stack import (
    FIXTURE_HOST,
    ExporterProcess,
    PodHolding,
    QueueLoad,
    exporter_arguments,
    fixture_card_uuids,
    pod_resources_server,
    running_exporter,
)
from tests.chart.prometheus_server import PrometheusApi, free_port, running_prometheus
from tests.chart.scrape_config import Target, build_scrape_config, discovered
from tests.chart.test_metric_names import PROMETHEUS_SYNTHETIC, owner, used_names
from tests.chart.tools import CHART, REPO, Rendered, render, require_tool
from tests.integration.device.fake_kubelet import short_tempdir
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow

INTERVAL = "1s"  # scrape and rule evaluation; the chart's 15s (monitoring-values) scaled down
SERVICE_NAMESPACE = "ml"  # where the KunlunInferenceService lives
HELD_CARDS = ("xpu4", "xpu5")  # held by the runtime pod, as the fake kubelet says
FIRED_ALERT = "KunlunRequestQueueGrowing"
# The chart says `for: 10m`; only this is shortened, so that the alert fires within the test.
FIRED_FOR = "2s"
SCRAPED_COMPONENTS = frozenset({"runtime", "exporter"})
DEADLINE_SECONDS = 120.0

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Stack:
    prometheus: PrometheusApi
    rendered: Rendered
    runtime_url: str
    model_name: str
    runtime_pod: str


@dataclass(frozen=True, slots=True)
class RuntimeDeployment:
    """What the operator builds for examples/kis-minimal.yaml with a metrics token, and the one
    pod the test plays (its name is made up; kubelet would generate it)."""

    monitor: dict[str, Any]
    service: dict[str, Any]
    deployment: dict[str, Any]
    pod: str
    container: str
    model_name: str  # --served-model-name
    token_secret: tuple[str, str]  # (Secret, key) the runtime reads KUNLUN_METRICS_TOKEN from
    speculative_config: str  # --speculative-config (the dashboard's speculative decoding row)


def runtime_deployment() -> RuntimeDeployment:
    kis = yaml.safe_load((REPO / "examples" / "kis-minimal.yaml").read_text())
    kis["spec"]["metricsTokenSecretRef"] = {"name": "qwen2-7b-metrics", "key": "token"}
    kis["spec"]["runtime"] = {"speculative": {"method": "ngram", "numSpeculativeTokens": 3}}
    spec = parse_spec(kis["spec"])
    ref = ServiceRef(kis["metadata"]["name"], SERVICE_NAMESPACE, "uid-1", 1)
    deployment = build_deployment(ref, spec, image="unused", config_hash="0", image_volumes=False, replicas=1)
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    (token_env,) = [e for e in container["env"] if e["name"] == "KUNLUN_METRICS_TOKEN"]
    secret = token_env["valueFrom"]["secretKeyRef"]
    return RuntimeDeployment(
        monitor=build_servicemonitor(ref, spec),
        service=build_service(ref, spec),
        deployment=deployment,
        pod=f"{deployment['metadata']['name']}-5d8f9c7b6-x2kqz",
        container=container["name"],
        model_name=args[args.index("--served-model-name") + 1],
        token_secret=(secret["name"], secret["key"]),
        speculative_config=args[args.index("--speculative-config") + 1],
    )


def rule_groups(rendered: Rendered) -> list[dict]:
    groups = copy.deepcopy(rendered.one("PrometheusRule")["spec"]["groups"])
    rules = [rule for group in groups for rule in group["rules"] if rule.get("alert") == FIRED_ALERT]
    assert len(rules) == 1, f"the chart has no single {FIRED_ALERT}"
    rules[0]["for"] = FIRED_FOR
    return groups


def waiting_threshold(rendered: Rendered) -> float:
    """The waiting-requests threshold in the rendered KunlunRequestQueueGrowing expression."""
    groups = rendered.one("PrometheusRule")["spec"]["groups"]
    (expr,) = [r["expr"] for g in groups for r in g["rules"] if r.get("alert") == FIRED_ALERT]
    match = re.search(r"\(vllm:num_requests_waiting\) > ([0-9.]+)", expr)
    assert match, expr
    return float(match.group(1))


def wait_explained(predicate: Callable[[], T], message: str, explain: Callable[[], str]) -> T:
    """`wait_for` with the deadline's error extended by `explain()` (what Prometheus saw)."""
    try:
        return wait_for(predicate, timeout_seconds=DEADLINE_SECONDS, message=message)
    except AssertionError as error:
        raise AssertionError(f"{error}\n{explain()}") from None


def scraped_enough(prometheus: PrometheusApi, jobs: int) -> bool:
    """Every target up and scraped at least twice (rate() needs two points)."""
    targets = prometheus.targets()
    counts = prometheus.query(f"count_over_time(up[{DEADLINE_SECONDS:.0f}s]) >= 2")
    return len(targets) == jobs and all(t["health"] == "up" for t in targets) and len(counts) == jobs


def start_exporter(
    started: contextlib.ExitStack, rendered: Rendered, workdir: Path, runtime: RuntimeDeployment
) -> tuple[ExporterProcess, Target]:
    """The chart's exporter on the fixture host, told by a fake kubelet that the runtime pod holds
    HELD_CARDS; returns the process (not yet waited for) and its scrape target."""
    daemonset = rendered.one("DaemonSet", "-device-plugin")
    containers = daemonset["spec"]["template"]["spec"]["containers"]
    (exporter,) = [c for c in containers if c["name"] == "exporter"]
    cards = fixture_card_uuids()
    holding = PodHolding(
        SERVICE_NAMESPACE, runtime.pod, runtime.container, tuple(cards[d] for d in HELD_CARDS)
    )
    sockets = started.enter_context(short_tempdir())
    started.enter_context(pod_resources_server(sockets / "kubelet.sock", holding))
    port = free_port()
    mapped = {
        "--listen-address": "127.0.0.1",
        "--port": str(port),
        "--pod-resources-socket": str(sockets / "kubelet.sock"),
        "--quarantine-file": str(workdir / "quarantine.json"),
    }
    arguments = exporter_arguments(exporter["args"], FIXTURE_HOST, mapped)
    process = started.enter_context(running_exporter(arguments, port, "node-a", workdir / "exporter.log"))
    service = rendered.one("Service", "-device-plugin-metrics")
    monitor = rendered.one("ServiceMonitor", "-device-plugin")
    pod = f"{daemonset['metadata']['name']}-x7k2p"
    return process, discovered(monitor, service, daemonset, pod, f"127.0.0.1:{port}")


def start_runtime(
    started: contextlib.ExitStack, workdir: Path, runtime: RuntimeDeployment, token: str
) -> str:
    """The live runtime (in this process, as the server tests run it), with the operator's
    speculative config, after one request that made it propose drafts; returns its base URL."""
    # Imported here: they bring torch, which the other chart tests need not load at collection.
    from kunlun_runtime.config import parse_speculative_config
    from tests.integration.server.live import serve_in_thread
    from tests.support.tiny_models import make_tiny_llama_without_transformers

    model_dir = make_tiny_llama_without_transformers(workdir / "tiny-chat")
    server = started.enter_context(
        serve_in_thread(
            model_dir,
            app_options={"metrics_token": token},
            served_model_name=runtime.model_name,
            max_num_seqs=1,
            speculative_config=parse_speculative_config(runtime.speculative_config),
        )
    )
    propose_drafts(server.base_url, runtime.model_name, token)
    return server.base_url


def propose_drafts(base_url: str, model_name: str, token: str) -> None:
    """One greedy request whose prompt repeats itself, so that n-gram drafts are found (the
    speculative panels need the runtime's draft counters, the per-position one included, which
    appear once a position was drafted)."""
    body = {"model": model_name, "prompt": "abc " * 16, "max_tokens": 16, "temperature": 0.0}
    httpx.post(f"{base_url}/v1/completions", json=body, timeout=60).raise_for_status()
    scrape = httpx.get(f"{base_url}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=10).text
    drafts = re.search(r"^vllm:spec_decode_num_drafts_total\{[^}]*\} ([0-9.e+]+)$", scrape, re.M)
    assert drafts and float(drafts.group(1)) > 0, "the runtime proposed no drafts:\n" + scrape


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    binary = require_tool("prometheus")
    rendered = render(CHART / "ci" / "monitoring-values.yaml")
    workdir = tmp_path_factory.mktemp("prometheus-live")
    runtime = runtime_deployment()
    token = secrets.token_hex(16)  # the Secret's value: the runtime requires it, Prometheus sends it
    token_file = workdir / "metrics-token"
    token_file.write_text(token)
    with contextlib.ExitStack() as started:
        exporter, exporter_target = start_exporter(started, rendered, workdir, runtime)
        runtime_url = start_runtime(started, workdir, runtime, token)  # meanwhile the exporter starts
        exporter.wait_ready()
        runtime_target = discovered(
            runtime.monitor,
            runtime.service,
            runtime.deployment,
            runtime.pod,
            runtime_url.removeprefix("http://"),
        )
        exporter_monitor = rendered.one("ServiceMonitor", "-device-plugin")
        scrape_configs = [
            build_scrape_config(
                runtime.monitor,
                0,
                runtime_target,
                interval=INTERVAL,
                secrets={runtime.token_secret: token_file},
            ),
            build_scrape_config(exporter_monitor, 0, exporter_target, interval=INTERVAL),
        ]
        groups = rule_groups(rendered)
        prometheus = started.enter_context(
            running_prometheus(
                binary,
                workdir,
                scrape_configs=scrape_configs,
                rule_groups=groups,
                evaluation_interval=INTERVAL,
            )
        )
        wait_explained(
            lambda: scraped_enough(prometheus, len(scrape_configs)),
            "Prometheus to scrape every target successfully twice",
            lambda: json.dumps(prometheus.targets(), indent=1) + "\n" + prometheus.log(),
        )
        yield Stack(prometheus, rendered, runtime_url, runtime.model_name, runtime.pod)


def test_every_series_the_dashboard_and_alerts_use_is_scraped(stack: Stack) -> None:
    used = used_names(stack.rendered)
    checked = {n for n in used if owner(n) in SCRAPED_COMPONENTS or n in PROMETHEUS_SYNTHETIC}
    assert {n for n in used if n not in checked} == {n for n in used if owner(n) == "operator"}
    missing = {name: sorted(used[name]) for name in checked - stack.prometheus.metric_names()}
    assert missing == {}, "used by the dashboard or alerts but absent from the live scrape"


def test_the_runtime_target_carries_the_labels_the_alerts_select_and_join_on(stack: Stack) -> None:
    # Prometheus scrapes it only with the token from the Secret the operator's ServiceMonitor names.
    assert httpx.get(f"{stack.runtime_url}/metrics", timeout=10).status_code == 401
    groups = stack.rendered.one("PrometheusRule")["spec"]["groups"]
    (down,) = [r["expr"] for g in groups for r in g["rules"] if r["alert"] == "KunlunRuntimeDown"]
    up = stack.prometheus.query(down.removesuffix(" == 0"))  # KunlunRuntimeDown's selector of `up`
    assert [(s["metric"]["namespace"], s["metric"]["pod"], s["value"][1]) for s in up] == [
        (SERVICE_NAMESPACE, stack.runtime_pod, "1")
    ]
    running = stack.prometheus.query("vllm:num_requests_running")
    assert [(s["metric"]["namespace"], s["metric"]["pod"], s["metric"]["model_name"]) for s in running] == [
        (SERVICE_NAMESPACE, stack.runtime_pod, stack.model_name)
    ]


def rules_evaluated(prometheus: PrometheusApi) -> list[dict[str, Any]]:
    """Every loaded rule, once each has been evaluated at least once; else []."""
    rules = [rule for group in prometheus.get("/api/v1/rules")["groups"] for rule in group["rules"]]
    return rules if all(not r["lastEvaluation"].startswith("0001-") for r in rules) else []


def test_every_chart_rule_is_loaded_and_evaluates_cleanly_on_live_data(stack: Stack) -> None:
    rules = wait_explained(
        lambda: rules_evaluated(stack.prometheus), "every rule to be evaluated once", stack.prometheus.log
    )
    chart_rules = [r for g in stack.rendered.one("PrometheusRule")["spec"]["groups"] for r in g["rules"]]
    assert sorted(r["name"] for r in rules) == sorted(r["alert"] for r in chart_rules)
    assert {r["name"]: (r["health"], r.get("lastError", "")) for r in rules} == {
        r["alert"]: ("ok", "") for r in chart_rules
    }


def dashboard_queries(rendered: Rendered) -> list[tuple[str, str]]:
    """(panel title, expression) of every dashboard target."""
    dashboard = json.loads(rendered.one("ConfigMap", "-dashboard")["data"]["kunlun-inference.json"])
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]


def grafana_expanded(expr: str, stack: Stack) -> str:
    """The query Grafana sends with the namespace and model variables set to the live runtime's."""
    expr = expr.replace("$namespace", SERVICE_NAMESPACE).replace("$model", stack.model_name)
    return expr.replace("$__rate_interval", "1m")


# Expressions filtered to the bad cases (`== 0`) are empty while every card is healthy.
EMPTY_WHEN_HEALTHY = frozenset({"Unhealthy cards"})
# Chip panels: what each held card's value must be, computed from the exporter's raw series.
CHIP_PANELS = {
    "XPU utilisation": "kunlun_xpu_utilization_ratio{S}",
    "XPU memory used": "kunlun_xpu_memory_used_bytes{S} / kunlun_xpu_memory_total_bytes{S}",
    "XPU temperature": "kunlun_xpu_temperature_celsius{S}",
    "XPU power": "kunlun_xpu_power_watts{S}",
}


def by_device(result: list[dict[str, Any]]) -> dict[str, float]:
    return {s["metric"]["device"]: float(s["value"][1]) for s in result}


def test_every_dashboard_query_answers_and_chip_panels_join_the_model(stack: Stack) -> None:
    at = time.time()  # every query at one instant: a panel and its expected values see the same samples
    holder = f'namespace="{SERVICE_NAMESPACE}", pod="{stack.runtime_pod}"'
    for title, expr in dashboard_queries(stack.rendered):
        result = stack.prometheus.query(grafana_expanded(expr, stack), at)
        if title in EMPTY_WHEN_HEALTHY:
            assert result == [], (title, result)
            continue
        assert result, f"panel {title!r} has no data: {expr}"
        if title in CHIP_PANELS:
            assert {s["metric"]["model_name"] for s in result} == {stack.model_name}, title
            expected = by_device(
                stack.prometheus.query(CHIP_PANELS[title].replace("{S}", f"{{{holder}}}"), at)
            )
            assert sorted(expected) == sorted(HELD_CARDS), title
            assert by_device(result) == expected, f"panel {title!r} must show each held card's own value"


def test_the_hpa_metrics_come_from_the_adapter_rule_in_the_docs(stack: Stack) -> None:
    rule = adapter_rule()
    found = stack.prometheus.series(rule["seriesQuery"])
    assert {s["__name__"] for s in found} >= set(METRIC_NAMES.values())
    assert all(s.get("namespace") and s.get("pod") for s in found), found
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
    for metric in METRIC_NAMES.values():
        # The adapter serves each series under the name `name.as` makes of it: the HPA's name.
        assert re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), metric) == metric
        query = adapter_query(rule, metric, stack.runtime_pod)
        result = stack.prometheus.query(query)
        assert [s["metric"] for s in result] == [{"pod": stack.runtime_pod}], (query, result)
        assert math.isfinite(float(result[0]["value"][1])), (query, result)


def adapter_rule() -> dict[str, Any]:
    """The one prometheus-adapter rule of docs/operator.md ("Autoscaling metrics")."""
    section = (REPO / "docs" / "operator.md").read_text().split("## Autoscaling metrics", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block, "docs/operator.md: no adapter rule under 'Autoscaling metrics'"
    (rule,) = yaml.safe_load(block.group(1))["rules"]
    return dict(rule)


def adapter_query(rule: dict[str, Any], metric: str, pod: str) -> str:
    """The rule's metricsQuery as the adapter fills it for an HPA's per-pod query of `metric`
    (resource `pods`, namespace SERVICE_NAMESPACE, the pods the HPA selects: here `pod`)."""
    matchers = f'namespace="{SERVICE_NAMESPACE}",pod=~"{pod}"'
    query = rule["metricsQuery"].replace("<<.Series>>", metric).replace("<<.LabelMatchers>>", matchers)
    return str(query.replace("<<.GroupBy>>", "pod"))


def firing(prometheus: PrometheusApi, name: str) -> list[dict[str, Any]]:
    return [a for a in prometheus.alerts() if a["labels"]["alertname"] == name and a["state"] == "firing"]


def test_waiting_requests_fire_the_queue_alert_end_to_end(stack: Stack) -> None:
    threshold = waiting_threshold(stack.rendered)
    # With one sequence running, in_flight - 1 wait; one finishing briefly leaves in_flight - 2.
    body = {"model": stack.model_name, "prompt": "hello", "max_tokens": 64, "ignore_eos": True}
    load = QueueLoad(stack.runtime_url, body, in_flight=int(threshold) + 3)
    load.start()
    try:
        alerts = wait_explained(
            lambda: firing(stack.prometheus, FIRED_ALERT),
            f"{FIRED_ALERT} to fire",
            lambda: json.dumps(
                {
                    "alerts": stack.prometheus.alerts(),
                    "waiting": stack.prometheus.query("vllm:num_requests_waiting"),
                    "targets": stack.prometheus.targets(),  # a failed scrape resets a pending alert
                    "load failures": load.failures,
                    "load requests completed": load.completed,
                },
                indent=1,
            ),
        )
        # What an HPA on requestsWaiting reads meanwhile, through the adapter rule's query.
        query = adapter_query(adapter_rule(), METRIC_NAMES["requestsWaiting"], stack.runtime_pod)
        waiting = stack.prometheus.query(query)
    finally:
        load.stop()
    assert load.failures == []
    assert [a["labels"] for a in alerts] == [
        {
            "alertname": FIRED_ALERT,
            "namespace": SERVICE_NAMESPACE,
            "model_name": stack.model_name,
            "severity": "warning",
        }
    ]
    assert alerts[0]["annotations"]["summary"].startswith(f"Model {stack.model_name} has ")
    assert alerts[0]["annotations"]["runbook_url"].endswith("#kunlunrequestqueuegrowing")
    assert float(waiting[0]["value"][1]) > threshold

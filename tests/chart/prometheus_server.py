"""A real Prometheus server on loopback, started from `.tools/bin/prometheus`, and its HTTP API.

Owns: writing the configuration and rule files, starting the process on a free port, waiting until
it is ready, the few API calls the tests make (instant queries, series, metric names, alerts) and
stopping it. Invariant: the process never outlives the `running_prometheus` context; every wait has
a deadline and fails naming what it waited for, with the server's log.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.support.waiting import wait_for

READY_DEADLINE_SECONDS = 60.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass(frozen=True, slots=True)
class PrometheusApi:
    """The HTTP API of one running Prometheus."""

    base_url: str
    log_path: Path

    def get(self, path: str, **params: Any) -> Any:
        """`data` of a successful API answer; fails with Prometheus's error otherwise."""
        response = httpx.get(f"{self.base_url}{path}", params=params, timeout=10)
        body = response.json()
        assert response.status_code == 200 and body["status"] == "success", (path, params, body)
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant vector: [{"metric": labels, "value": [time, "text"]}, ...]."""
        params = {"query": expr} if at is None else {"query": expr, "time": at}
        data = self.get("/api/v1/query", **params)
        assert data["resultType"] == "vector", (expr, data)
        return list(data["result"])

    def metric_names(self) -> set[str]:
        return set(self.get("/api/v1/label/__name__/values"))

    def series(self, match: str) -> list[dict[str, str]]:
        return list(self.get("/api/v1/series", **{"match[]": match}))

    def alerts(self) -> list[dict[str, Any]]:
        return list(self.get("/api/v1/alerts")["alerts"])

    def targets(self) -> list[dict[str, Any]]:
        return list(self.get("/api/v1/targets")["activeTargets"])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def ready(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/-/ready", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


@contextlib.contextmanager
def running_prometheus(
    binary: Path,
    workdir: Path,
    *,
    scrape_configs: list[dict[str, Any]],
    rule_groups: list[dict[str, Any]],
    evaluation_interval: str,
) -> Iterator[PrometheusApi]:
    """Prometheus scraping `scrape_configs` and evaluating `rule_groups` every
    `evaluation_interval`, with its data and log under `workdir`; stopped (then killed) on exit."""
    rules = workdir / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": rule_groups}, sort_keys=False, allow_unicode=True))
    config = workdir / "prometheus.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "global": {"evaluation_interval": evaluation_interval},
                "rule_files": [str(rules)],
                "scrape_configs": scrape_configs,
            },
            sort_keys=False,
        )
    )
    port = free_port()
    log_path = workdir / "prometheus.log"
    command = [
        str(binary),
        f"--config.file={config}",
        f"--storage.tsdb.path={workdir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
    ]
    base_url = f"http://127.0.0.1:{port}"
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
    api = PrometheusApi(base_url, log_path)
    try:
        wait_for(
            lambda: ready(base_url) or process.poll() is not None,
            timeout_seconds=READY_DEADLINE_SECONDS,
            message=f"Prometheus to answer {base_url}/-/ready",
        )
        assert process.poll() is None, f"prometheus exited with {process.returncode}:\n{api.log()}"
        yield api
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)

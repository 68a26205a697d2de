"""The replicas of ``bench_routing.py``: ``kunlun-runtime serve`` processes on loopback, and what
an Endpoint Picker reads of them from ``/metrics``.

``fleet`` starts them all at once (each with ``OMP_NUM_THREADS`` set to its share of the machine,
its log in a temporary file), waits until every ``/health`` answers 200, reads each one's block
size and block count from ``vllm:cache_config_info``, and stops them all on the way out. A replica
that exits or never gets ready ends the benchmark with its log's tail.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from routing_picker import ReplicaLoad

READY_DEADLINE_SECONDS = 600.0
SERVE_MAIN = "import sys; from kunlun_runtime.commands.cli import main; sys.exit(main())"


@dataclass(slots=True)
class Replica:
    base_url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    events_endpoint: str | None  # where its KV events are published (precise mode), else None
    block_size: int = 0  # vllm:cache_config_info's labels, read once it is ready
    num_blocks: int = 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def replica_command(args, port: int, events_port: int | None) -> list[str]:
    command = [
        sys.executable, "-c", SERVE_MAIN, "serve", "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", args.served_model_name, "--kv-cache-memory", args.kv_cache_memory,
    ]  # fmt: skip
    if args.model:
        command += ["--model", args.model]
    if args.dtype:
        command += ["--dtype", args.dtype]
    if events_port is not None:
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events_port}"}
        command += ["--prefix-caching-hash-algo", "sha256_cbor", "--kv-events-config", json.dumps(config)]
    return command


def log_tail(path: Path, num_lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])


def wait_ready(replica: Replica, deadline: float) -> None:
    while time.monotonic() < deadline:
        if replica.process.poll() is not None:
            raise SystemExit(f"replica {replica.base_url} exited with {replica.process.returncode}:\n"
                             f"{log_tail(replica.log_path)}")  # fmt: skip
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{replica.base_url}/health", timeout=5).status_code == 200:
                return
        time.sleep(0.25)
    raise SystemExit(f"replica {replica.base_url} not ready after {READY_DEADLINE_SECONDS:.0f} s:\n"
                     f"{log_tail(replica.log_path)}")  # fmt: skip


@contextlib.contextmanager
def fleet(args, count: int, *, events: bool) -> Iterator[list[Replica]]:
    """``count`` ready replicas; with ``events`` each publishes KV events (hashes ``sha256_cbor``
    under ``PYTHONHASHSEED=args.hash_seed``) on a port of its own."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads_per_replica)}
    if events:
        env["PYTHONHASHSEED"] = args.hash_seed
    replicas: list[Replica] = []
    with tempfile.TemporaryDirectory(prefix="bench-routing-") as logs:
        try:
            for index in range(count):
                port, events_port = free_port(), free_port() if events else None
                log_path = Path(logs) / f"replica-{index}.log"
                with log_path.open("wb") as log:
                    process = subprocess.Popen(replica_command(args, port, events_port), env=env, stdout=log,
                                               stderr=subprocess.STDOUT)  # fmt: skip
                endpoint = f"tcp://127.0.0.1:{events_port}" if events_port else None
                replicas.append(Replica(f"http://127.0.0.1:{port}", process, log_path, endpoint))
            deadline = time.monotonic() + READY_DEADLINE_SECONDS
            for replica in replicas:
                wait_ready(replica, deadline)
                replica.block_size, replica.num_blocks = read_cache_config(replica.base_url)
            yield replicas
        finally:
            for replica in replicas:
                replica.process.terminate()
            for replica in replicas:
                try:
                    replica.process.wait(60)
                except subprocess.TimeoutExpired:
                    replica.process.kill()
                    replica.process.wait(10)


def machine_busy_seconds() -> float:
    """CPU seconds all cores have spent busy since boot (/proc/stat; NaN where there is none)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return float("nan")
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds(replicas: list[Replica]) -> float:
    """CPU seconds used so far by this process and the replicas (their /proc/PID/stat)."""
    times = os.times()
    total = times.user + times.system
    for replica in replicas:
        try:
            fields = Path(f"/proc/{replica.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return float("nan")
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    return total


def metric_samples(text: str) -> dict[str, list]:
    """Samples by family name, parsed as the picker parses them (Prometheus text format)."""
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def read_cache_config(base_url: str) -> tuple[int, int]:
    """(block_size, num_gpu_blocks) from ``vllm:cache_config_info``'s labels."""
    (info,) = metric_samples(httpx.get(f"{base_url}/metrics", timeout=30).text)["vllm:cache_config_info"]
    return int(info.labels["block_size"]), int(info.labels["num_gpu_blocks"])


async def read_load(http: httpx.AsyncClient, replica: Replica) -> ReplicaLoad:
    samples = metric_samples((await http.get(f"{replica.base_url}/metrics")).text)

    def gauge(name: str) -> float:
        return float(samples[name][0].value)

    return ReplicaLoad(
        gauge("vllm:num_requests_waiting"),
        gauge("vllm:num_requests_running"),
        gauge("vllm:kv_cache_usage_perc"),
    )


async def read_counters(http: httpx.AsyncClient, replica: Replica) -> tuple[float, float]:
    """(prefix-cache hit tokens, query tokens) so far."""
    samples = metric_samples((await http.get(f"{replica.base_url}/metrics")).text)
    return (
        float(samples["vllm:prefix_cache_hits"][0].value),
        float(samples["vllm:prefix_cache_queries"][0].value),
    )

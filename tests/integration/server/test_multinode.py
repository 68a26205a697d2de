"""Two "nodes" on one machine: ``serve --pipeline-parallel-size 2 --nnodes 2`` as two processes
joined over loopback, node 1 finding the leader through LeaderWorkerSet's environment.

The leader serves the embedded model through the real ``openai`` client with the tokens one
process gives; a worker killed mid-stream ends the stream with an error event and ``[DONE]``
and the leader exits non-zero; a dead leader takes the worker down; a worker that stops
answering while the server is idle fails the leader's health and the leader exits 1 within the
collective timeout. Started by hand without the leader's address, ``serve`` refuses to start; a
worker whose leader does not answer says where it looks and exits 1 after the timeout.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from kunlun_runtime import LLM, SamplingParams
from kunlun_runtime.parallel.rendezvous import try_connect
from tests.integration.server.live import SERVE_MAIN, free_port, health_status
from tests.support.waiting import wait_for

TIMEOUT_SECONDS = 4.0  # --distributed-timeout of the fault tests
SHORT_TIMEOUT = ("--distributed-timeout", str(TIMEOUT_SECONDS))


@dataclass
class Group:
    leader: subprocess.Popen[bytes]
    worker: subprocess.Popen[bytes]
    base_url: str
    logs: Path

    def stop(self) -> None:
        for process in (self.leader, self.worker):
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGCONT)  # a stopped process cannot die
                process.kill()
                process.wait(30)


@contextlib.contextmanager
def two_nodes(model_dir: Path, logs: Path, *extra: str, worker_first: bool = True) -> Iterator[Group]:
    """Node 1 (LWS_WORKER_INDEX=1) and the leader; yields once the leader's /health is 200.

    ``worker_first``: node 1 starts first, as pods may under LeaderWorkerSet, and waits for the
    leader; else it starts once the leader's rendezvous port accepts connections (a worker gives
    up on the leader after ``--distributed-timeout``, shorter in the fault tests than the leader's
    start on a busy machine)."""
    master_port, port = free_port(), free_port()
    common = [
        sys.executable, "-c", SERVE_MAIN, "serve", "--model", str(model_dir), "--dtype", "float32",
        "--kv-cache-memory", "16MiB", "--pipeline-parallel-size", "2", "--master-port", str(master_port),
        "--host", "127.0.0.1", "--port", str(port), *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # two "nodes" share this machine's cores
    lws = {"LWS_LEADER_ADDRESS": "127.0.0.1", "LWS_GROUP_SIZE": "2"}
    logs.mkdir(parents=True, exist_ok=True)
    with (logs / "worker.log").open("wb") as worker_log, (logs / "leader.log").open("wb") as leader_log:

        def start_worker() -> subprocess.Popen[bytes]:
            return subprocess.Popen(
                common,
                stdout=worker_log,
                stderr=subprocess.STDOUT,
                env={**env, **lws, "LWS_WORKER_INDEX": "1"},
            )

        worker = start_worker() if worker_first else None
        leader = subprocess.Popen(
            [*common, "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1"],
            stdout=leader_log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        if worker is None:
            wait_for(
                lambda: try_connect("127.0.0.1", master_port, 1.0) is None or leader.poll() is not None,
                timeout_seconds=300.0,
                message="the leader's rendezvous port",
            )
            worker = start_worker()
        group = Group(leader, worker, f"http://127.0.0.1:{port}", logs)
        try:
            wait_for(
                lambda: health_status(group.base_url) == 200 or leader.poll() is not None,
                timeout_seconds=300.0,
                message="the leader to become ready",
            )
            assert leader.poll() is None, (logs / "leader.log").read_text()[-3000:]
            yield group
        finally:
            group.stop()


def logs_of(group: Group) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(group.logs.glob("*.log")))


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    from kunlun_runtime.models.default_model import resolve_default_model

    return resolve_default_model(progress=False)


def test_two_nodes_serve_the_embedded_model_with_the_tokens_of_one_process(smollm2_dir, tmp_path):
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    reference = LLM(str(smollm2_dir), dtype="float32", max_model_len=512).chat(
        messages, SamplingParams(temperature=0, max_tokens=24)
    )[0]
    with two_nodes(smollm2_dir, tmp_path / "logs", "--max-model-len", "512") as group:
        client = OpenAI(base_url=f"{group.base_url}/v1", api_key="unused")
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=24)
        assert reply.choices[0].message.content == reference.outputs[0].text, logs_of(group)
        assert reply.usage.completion_tokens == len(reference.outputs[0].token_ids)
        # SIGTERM: the leader drains and stops the group; both exit 0
        group.leader.send_signal(signal.SIGTERM)
        assert group.leader.wait(60) == 0, logs_of(group)
        assert group.worker.wait(60) == 0, logs_of(group)
    worker_log = (tmp_path / "logs" / "worker.log").read_text()
    assert (
        "node 1: the leader at 127.0.0.1:" in worker_log
        and "is up; joining the group of 2 ranks" in worker_log
    )
    assert "node 1 ready: ranks [1], stage(s) [1] (backend gloo)" in worker_log
    assert "the leader stopped the group" in worker_log
    # the leader's wait for its nodes is said at serve's default log level (WARNING)
    leader_log = (tmp_path / "logs" / "leader.log").read_text()
    assert "rank 0: waiting for the 2 ranks of 2 nodes to join at port" in leader_log


def test_a_worker_killed_mid_stream_ends_the_stream_and_the_leader_exits_nonzero(tiny_model_dir, tmp_path):
    with two_nodes(tiny_model_dir, tmp_path / "logs", *SHORT_TIMEOUT, worker_first=False) as group:
        body = {"model": "tiny-chat", "prompt": "the", "max_tokens": 500, "ignore_eos": True, "stream": True}
        lines: list[str] = []
        with httpx.stream("POST", f"{group.base_url}/v1/completions", json=body, timeout=120) as reply:
            assert reply.status_code == 200
            for line in reply.iter_lines():
                if not line:
                    continue
                lines.append(line)
                if len(lines) == 5:  # tokens are flowing through both stages: kill stage 1
                    group.worker.kill()
        assert lines[-1] == "data: [DONE]", lines[-3:]
        assert '"error"' in lines[-2] and "parallel group" in lines[-2], lines[-2]
        began = time.monotonic()
        code = group.leader.wait(TIMEOUT_SECONDS + 30)
        assert code != 0, logs_of(group)
        assert time.monotonic() - began < TIMEOUT_SECONDS + 30


def test_a_dead_leader_takes_the_worker_down(tiny_model_dir, tmp_path):
    with two_nodes(tiny_model_dir, tmp_path / "logs", *SHORT_TIMEOUT, worker_first=False) as group:
        group.leader.kill()
        began = time.monotonic()
        assert group.worker.wait(TIMEOUT_SECONDS + 30) == 1, logs_of(group)
        assert time.monotonic() - began < TIMEOUT_SECONDS + 30
        assert "the parallel group failed" in (tmp_path / "logs" / "worker.log").read_text()


def test_a_worker_that_stops_answering_while_idle_fails_health_and_the_leader_exits_1(
    tiny_model_dir, tmp_path
):
    with two_nodes(tiny_model_dir, tmp_path / "logs", *SHORT_TIMEOUT, worker_first=False) as group:
        os.kill(group.worker.pid, signal.SIGSTOP)  # alive, holding its sockets, answering nothing
        began = time.monotonic()
        wait_for(
            lambda: health_status(group.base_url) != 200,
            timeout_seconds=TIMEOUT_SECONDS * 3 + 10,
            message="the leader's health to fail",
        )
        assert group.leader.wait(30) == 1, logs_of(group)
        assert time.monotonic() - began < TIMEOUT_SECONDS * 3 + 40
        assert "stopped answering" in (tmp_path / "logs" / "leader.log").read_text()


def serve_alone(*args: str) -> subprocess.CompletedProcess[str]:
    """One ``serve`` process with ``args``, outside any LeaderWorkerSet; its output once it exits."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LWS_")}
    return subprocess.run(
        [sys.executable, "-c", SERVE_MAIN, "serve", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env={**env, "OMP_NUM_THREADS": "1"},
    )


def test_several_nodes_without_the_leader_address_do_not_start(tiny_model_dir):
    done = serve_alone("--model", str(tiny_model_dir), "--pipeline-parallel-size", "2", "--nnodes", "2")
    assert done.returncode == 2, done.stderr
    assert (
        "kunlun-runtime serve: error: master_addr: --nnodes 2 (or $LWS_GROUP_SIZE) needs the leader's "
        "address: give --master-addr HOST" in done.stderr
    )


def test_a_worker_node_whose_leader_does_not_answer_logs_the_address_and_exits_1_after_the_timeout(
    tiny_model_dir,
):
    with socket.socket() as refusing:  # bound, never listening: every connection is refused
        refusing.bind(("127.0.0.1", 0))
        port = refusing.getsockname()[1]
        began = time.monotonic()
        done = serve_alone(
            "--model", str(tiny_model_dir), "--dtype", "float32", "--kv-cache-memory", "16MiB",
            "--pipeline-parallel-size", "2", "--nnodes", "2", "--node-rank", "1",
            "--master-addr", "127.0.0.1", "--master-port", str(port),
            "--distributed-timeout", str(TIMEOUT_SECONDS),
        )  # fmt: skip
        elapsed = time.monotonic() - began
    log = done.stdout + done.stderr
    assert done.returncode == 1, log
    assert f"node 1: cannot reach the leader at 127.0.0.1:{port} yet (attempt 1, 0 of 4 s): " in log
    assert f"node 1 could not reach the leader at 127.0.0.1:{port} within 4 s" in log
    assert "joining the group" not in log  # it never got past the probe
    assert TIMEOUT_SECONDS <= elapsed < TIMEOUT_SECONDS + 120  # the timeout, plus start-up on a busy machine

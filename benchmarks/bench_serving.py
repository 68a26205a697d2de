"""Serving benchmark: N concurrent streaming chat clients against an OpenAI-compatible server.

Reports output-token throughput, time to first token (TTFT) and inter-token latency (ITL), p50 and
p99, measured on the client side from server-sent events (a token's arrival is the chunk that
carries it; ``stream_options.include_usage`` gives the exact token counts). By default it starts
``kunlun-runtime serve`` itself (the embedded SmolLM2, or ``--model DIR``); ``--base-url`` points
it at a running server instead. When ``LLAMA_SERVER`` names a llama.cpp ``llama-server`` binary it
also starts that on the same model's GGUF (``LLAMA_SERVER_GGUF``, default: the embedded SmolLM2
GGUF) and prints both side by side with the ratio. These machines are noisy: compare within a run.

    .venv/bin/python benchmarks/bench_serving.py --num-clients 8 --max-tokens 64
    LLAMA_SERVER=/path/llama-server .venv/bin/python benchmarks/bench_serving.py
    .venv/bin/python benchmarks/bench_serving.py --base-url http://127.0.0.1:8000 --json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import httpx

PROMPTS = ["Tell me a short story about a robot.", "Explain what a paged KV cache is.", "List three colours."]
READY_DEADLINE_SECONDS = 600.0


@dataclass
class RequestResult:
    ttft_seconds: float
    itl_seconds: list[float]
    completion_tokens: int


@dataclass
class Report:
    server: str
    num_clients: int
    num_requests: int
    wall_seconds: float
    output_tokens_per_second: float
    ttft_p50_seconds: float
    ttft_p99_seconds: float
    itl_p50_seconds: float
    itl_p99_seconds: float
    completion_tokens: int
    errors: list[str] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def one_request(http: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> RequestResult:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    start = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                arrivals.append(time.perf_counter())
    ttft = (arrivals[0] - start) if arrivals else float("nan")
    return RequestResult(ttft, [b - a for a, b in itertools.pairwise(arrivals)], tokens)


async def run_load(base_url: str, model: str, num_clients: int, requests_per_client: int, max_tokens: int,
                   label: str) -> Report:  # fmt: skip
    results: list[RequestResult] = []
    errors: list[str] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:

        async def client(index: int) -> None:
            for turn in range(requests_per_client):
                prompt = PROMPTS[(index + turn) % len(PROMPTS)]
                try:
                    results.append(await one_request(http, model, prompt, max_tokens))
                except httpx.HTTPError as error:
                    errors.append(f"client {index}: {error!r}")

        start = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(num_clients)))
        wall = time.perf_counter() - start
    ttfts = [r.ttft_seconds for r in results]
    itls = [gap for r in results for gap in r.itl_seconds]
    tokens = sum(r.completion_tokens for r in results)
    return Report(
        server=label,
        num_clients=num_clients,
        num_requests=len(results),
        wall_seconds=wall,
        output_tokens_per_second=tokens / wall if wall else 0.0,
        ttft_p50_seconds=percentile(ttfts, 50),
        ttft_p99_seconds=percentile(ttfts, 99),
        itl_p50_seconds=percentile(itls, 50),
        itl_p99_seconds=percentile(itls, 99),
        completion_tokens=tokens,
        errors=errors,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(base_url: str, process: subprocess.Popen, health_path: str) -> None:
    deadline = time.monotonic() + READY_DEADLINE_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server exited with {process.returncode} before becoming ready")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(base_url + health_path, timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    raise SystemExit(f"server at {base_url} not ready after {READY_DEADLINE_SECONDS:.0f} s")


@contextlib.contextmanager
def started(command: list[str], port: int, health_path: str = "/health") -> Iterator[str]:
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base_url, process, health_path)
        yield base_url
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()


def ours_command(args: argparse.Namespace, port: int) -> list[str]:
    main = "import sys; from kunlun_runtime.commands.cli import main; sys.exit(main())"
    command = [sys.executable, "-c", main, "serve", "--host", "127.0.0.1", "--port", str(port)]
    if args.model:
        command += ["--model", args.model]
    return [
        *command,
        "--served-model-name",
        args.served_model_name,
        "--max-num-seqs",
        str(max(args.num_clients, 1)),
    ]


def llama_command(binary: str, port: int) -> list[str]:
    gguf = os.environ.get("LLAMA_SERVER_GGUF")
    if not gguf:
        from kunlun_runtime.models.default_model import default_model_gguf

        gguf = str(default_model_gguf())
    return [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "--parallel", "8", "-c", "8192"]


def print_table(reports: list[Report]) -> None:
    columns = ("server", "requests", "tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99")
    print("  ".join(f"{c:>12}" for c in columns))
    for r in reports:
        latencies = (r.ttft_p50_seconds, r.ttft_p99_seconds, r.itl_p50_seconds, r.itl_p99_seconds)
        cells = (
            r.server,
            r.num_requests,
            f"{r.output_tokens_per_second:.1f}",
            *(f"{v * 1000:.1f} ms" for v in latencies),
        )
        print("  ".join(f"{c!s:>12}" for c in cells))
    if len(reports) == 2 and reports[1].output_tokens_per_second:
        ratio = reports[0].output_tokens_per_second / reports[1].output_tokens_per_second
        print(f"throughput ratio kunlun-runtime / llama-server: {ratio:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--base-url", default=None, help="benchmark this running server instead of starting one"
    )
    parser.add_argument("--model", default=None, help="model directory for the started server")
    parser.add_argument("--served-model-name", default="SmolLM2-135M-Instruct")
    parser.add_argument("--num-clients", type=int, default=8)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    load = (args.served_model_name, args.num_clients, args.requests_per_client, args.max_tokens)
    reports = []
    if args.base_url:
        reports.append(asyncio.run(run_load(args.base_url, *load, label="kunlun-runtime")))
    else:
        port = free_port()
        with started(ours_command(args, port), port) as base_url:
            reports.append(asyncio.run(run_load(base_url, *load, label="kunlun-runtime")))
    llama = os.environ.get("LLAMA_SERVER")
    if llama:
        port = free_port()
        with started(llama_command(llama, port), port) as base_url:
            reports.append(asyncio.run(run_load(base_url, *load, label="llama-server")))
    if args.json:
        print(json.dumps({"reports": [asdict(r) for r in reports]}))
    else:
        print_table(reports)
    return 1 if any(r.errors for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())

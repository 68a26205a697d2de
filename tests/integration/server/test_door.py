"""The server's door: keys and body limits decided before a body is read, /metrics behind a token,
the server's memory bounded under large unauthorized bodies, and no filesystem path in /v1/models."""

from __future__ import annotations

import asyncio
import http.client
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psutil
import pytest

from kunlun_runtime.server.auth import Tenants
from tests.integration.server.live import LiveServer, serve_in_thread, start_serve_process

MAX_BODY_BYTES = 64 << 10
METRICS_TOKEN = "scrape-token"
KEYS = {"alice": "key-alice", "bob": "key-bob"}
HUGE_BYTES = 60 << 20
NUM_HUGE_BODIES = 4
RSS_GROWTH_BOUND_BYTES = 100 << 20


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def door_server(tiny_model_dir: Path) -> Iterator[LiveServer]:
    options = {
        "tenants": Tenants(KEYS),
        "max_request_body_bytes": MAX_BODY_BYTES,
        "metrics_token": METRICS_TOKEN,
    }
    with serve_in_thread(tiny_model_dir, app_options=options) as server:
        server.api_key = KEYS["alice"]
        yield server


def post_headers_only(
    server: LiveServer, path: str, headers: dict[str, str], length: int
) -> tuple[int, dict]:
    """Send a POST's headers declaring ``length`` body bytes, send no body, read the answer.

    A server that read the body before answering would wait here until the timeout.
    """
    url = urlsplit(server.base_url)
    connection = http.client.HTTPConnection(url.hostname or "", url.port, timeout=20)
    try:
        connection.putrequest("POST", path)
        for name, value in {
            **headers,
            "Content-Type": "application/json",
            "Content-Length": str(length),
        }.items():
            connection.putheader(name, value)
        connection.endheaders()
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_a_request_without_a_valid_key_is_refused_before_its_body_is_read(door_server: LiveServer) -> None:
    for headers in ({}, bearer("wrong"), bearer(METRICS_TOKEN)):
        status, body = post_headers_only(door_server, "/v1/completions", headers, 10**9)
        assert status == 401
        assert body["error"]["type"] == "AuthenticationError"
        assert body["error"]["code"] == 401


def test_a_declared_body_over_the_limit_is_413_naming_the_limit_before_it_is_read(
    door_server: LiveServer,
) -> None:
    status, body = post_headers_only(
        door_server, "/v1/chat/completions", bearer(KEYS["bob"]), MAX_BODY_BYTES + 1
    )
    assert status == 413
    assert body == {
        "error": {
            "message": f"request body too large: the limit is {MAX_BODY_BYTES} bytes (--max-request-body-bytes)",
            "type": "RequestTooLargeError",
            "param": None,
            "code": 413,
        }
    }


def test_an_undeclared_chunked_body_is_cut_off_at_the_limit(door_server: LiveServer) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(16):
            yield b"a" * (16 << 10)
        yield b'"}'

    response = httpx.post(
        f"{door_server.base_url}/v1/completions", content=chunks(), headers=door_server.headers, timeout=60
    )
    assert response.status_code == 413
    assert str(MAX_BODY_BYTES) in response.json()["error"]["message"]


def test_a_body_within_the_limit_is_served(door_server: LiveServer) -> None:
    body = {"model": door_server.model_name, "prompt": "a " * 100, "max_tokens": 2}
    response = httpx.post(
        f"{door_server.base_url}/v1/completions", json=body, headers=door_server.headers, timeout=60
    )
    assert response.status_code == 200, response.text


def test_metrics_need_the_metrics_token_and_an_api_key_is_not_one(door_server: LiveServer) -> None:
    url = f"{door_server.base_url}/metrics"
    assert httpx.get(url, timeout=10).status_code == 401
    assert httpx.get(url, headers=bearer(KEYS["alice"]), timeout=10).status_code == 401
    refused = httpx.get(url, headers=bearer("scrape-toke"), timeout=10)
    assert refused.status_code == 401
    assert refused.json()["error"]["type"] == "AuthenticationError"
    assert httpx.get(url, headers=bearer(METRICS_TOKEN), timeout=10).status_code == 200
    assert httpx.get(f"{door_server.base_url}/health", timeout=10).status_code == 200


def test_models_name_the_served_model_and_no_path(door_server: LiveServer) -> None:
    response = httpx.get(f"{door_server.base_url}/v1/models", headers=door_server.headers, timeout=10)
    assert response.status_code == 200
    [card] = response.json()["data"]
    assert card["id"] == card["root"] == door_server.model_name
    assert str(door_server.model_dir) not in response.text


def test_the_openapi_document_lists_413_and_401(door_server: LiveServer) -> None:
    paths = httpx.get(f"{door_server.base_url}/openapi.json", timeout=10).json()["paths"]
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        assert {"401", "413"} <= set(paths[path]["post"]["responses"]), path
    assert "401" in paths["/metrics"]["get"]["responses"]


async def test_large_bodies_leave_the_server_memory_bounded(tiny_model_dir: Path, tmp_path: Path) -> None:
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text("".join(f"{tenant}: {key}\n" for tenant, key in KEYS.items()))
    process, base_url = start_serve_process(
        tiny_model_dir, "--api-keys-file", str(keys_file), "--uvicorn-log-level", "warning"
    )
    try:
        server = psutil.Process(process.pid)
        rss_before = server.memory_info().rss
        huge = b'{"prompt": "' + b"a" * HUGE_BYTES + b'"}'

        async def chunked() -> AsyncIterator[bytes]:
            for start in range(0, len(huge), 1 << 20):
                yield huge[start : start + (1 << 20)]

        async with httpx.AsyncClient(base_url=base_url, timeout=120) as http_client:
            unauthorized = [http_client.post("/v1/completions", content=huge) for _ in range(NUM_HUGE_BODIES)]
            authorized = [
                http_client.post("/v1/completions", content=chunked(), headers=bearer(KEYS["bob"]))
                for _ in range(NUM_HUGE_BODIES)
            ]
            responses = await asyncio.gather(*unauthorized, *authorized)
        rss_after = server.memory_info().rss
        assert [r.status_code for r in responses] == [401] * NUM_HUGE_BODIES + [413] * NUM_HUGE_BODIES
        assert rss_after - rss_before < RSS_GROWTH_BOUND_BYTES, (rss_before, rss_after)
    finally:
        process.terminate()
        process.wait(60)

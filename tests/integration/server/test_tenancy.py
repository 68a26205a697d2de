"""Tenants on a live server: no prefix-cache sharing across API keys, and no tenant may fill the
waiting queue for the others."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kunlun_runtime.server.auth import Tenants
from tests.integration.server.live import LiveServer, sample, scrape, serve_in_thread

KEYS = {"alice": "key-alice", "bob": "key-bob"}
METRICS_TOKEN = "scrape-token"
PROMPT = "the quick brown fox jumps over the lazy dog " * 6  # several full 16-token blocks


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def tenant_server(tiny_model_dir: Path) -> Iterator[LiveServer]:
    options = {"tenants": Tenants(KEYS), "metrics_token": METRICS_TOKEN, "max_waiting_share": 0.5}
    with serve_in_thread(tiny_model_dir, max_queue_len=4, max_num_seqs=1, app_options=options) as server:
        yield server


def prefix_hits(server: LiveServer) -> float:
    metrics = scrape(server.base_url, headers=bearer(METRICS_TOKEN))
    return sample(metrics, "vllm:prefix_cache_hits_total", model_name=server.model_name)


def hits_of_one_completion(server: LiveServer, tenant: str, **extra: object) -> float:
    before = prefix_hits(server)
    body = {"model": server.model_name, "prompt": PROMPT, "max_tokens": 1, **extra}
    response = httpx.post(
        f"{server.base_url}/v1/completions", json=body, headers=bearer(KEYS[tenant]), timeout=60
    )
    assert response.status_code == 200, response.text
    return prefix_hits(server) - before


def test_one_tenant_never_hits_another_tenants_cached_prompt(tenant_server: LiveServer) -> None:
    assert hits_of_one_completion(tenant_server, "alice") == 0
    assert hits_of_one_completion(tenant_server, "bob") == 0
    assert hits_of_one_completion(tenant_server, "bob", cache_salt="alice") == 0
    assert hits_of_one_completion(tenant_server, "alice") > 0  # the cache works within a tenant
    assert hits_of_one_completion(tenant_server, "alice", cache_salt="mine") == 0  # a salt narrows


async def test_one_tenant_cannot_fill_the_waiting_queue(tenant_server: LiveServer) -> None:
    long = {"model": tenant_server.model_name, "prompt": "go", "max_tokens": 300, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=tenant_server.base_url, timeout=300) as http:
        burst = [
            asyncio.ensure_future(http.post("/v1/completions", json=long, headers=bearer(KEYS["alice"])))
            for _ in range(6)
        ]

        # The refusals come back at once, while alice's admitted requests still run or wait.
        _, still_open = await asyncio.wait(burst, timeout=60, return_when=asyncio.FIRST_COMPLETED)
        assert still_open, "alice's admitted requests should still be running or waiting"
        short = {**long, "max_tokens": 2}
        bobs = await http.post("/v1/completions", json=short, headers=bearer(KEYS["bob"]))
        alices = await asyncio.gather(*burst)
    assert bobs.status_code == 200, bobs.text
    refused = [r for r in alices if r.status_code != 200]
    # Alice may hold two of the four waiting places. Of six sent at once, one runs and two wait,
    # so three are refused; a request just taken in counts as waiting until the next step recounts
    # (never more than the share, possibly one fewer admitted), and on a loaded machine the running
    # one may finish while the burst still arrives: between two and four are refused, each for the
    # share, never for the whole queue, and bob still gets in.
    assert 2 <= len(refused) <= 4
    for response in refused:
        assert response.status_code == 429
        assert response.headers["Retry-After"] == "1"
        error = response.json()["error"]
        assert error["type"] == "RateLimitError"
        assert "--max-waiting-share 0.5" in error["message"]


def test_a_group_larger_than_a_tenants_share_is_a_400_naming_n(tenant_server: LiveServer) -> None:
    # Alice's share is two of the four places: a group of three could never be admitted, so
    # "retry later" would be a lie; a group of two fits and is served.
    body = {"model": tenant_server.model_name, "prompt": "go", "max_tokens": 2}
    url = f"{tenant_server.base_url}/v1/completions"
    too_many = httpx.post(url, json={**body, "n": 3}, headers=bearer(KEYS["alice"]), timeout=60)
    assert too_many.status_code == 400, too_many.text
    error = too_many.json()["error"]
    assert error["param"] == "n"
    assert "--max-waiting-share 0.5" in error["message"]
    fits = httpx.post(url, json={**body, "n": 2}, headers=bearer(KEYS["alice"]), timeout=60)
    assert fits.status_code == 200, fits.text
    assert len(fits.json()["choices"]) == 2

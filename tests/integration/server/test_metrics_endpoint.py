"""/metrics of a live server: parses, carries vLLM's names for this model, counts what happened."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from kunlun_runtime.server.metrics import METRIC_NAMES
from tests.integration.server.live import LiveServer, sample, scrape

REPO = Path(__file__).resolve().parents[3]
# vLLM's own names trip two of promtool's style lints; they are the contract, so they stay.
VLLM_NAME_LINTS = (
    "metric names should not contain ':'",
    'non-counter metrics should not have "_total" suffix',
)


def completion(server: LiveServer, **body: object) -> dict:
    payload = {"model": server.model_name, "prompt": "the cat", "max_tokens": 4, "ignore_eos": True, **body}
    response = httpx.post(
        f"{server.base_url}/v1/completions", json=payload, headers=server.headers, timeout=60
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_metrics_carry_every_vllm_name_with_the_model_name_label(live_server) -> None:
    completion(live_server)
    names = {name for name, _ in scrape(live_server.base_url)}
    for family in METRIC_NAMES:
        if family.startswith("kunlun:device_temperature") or family.startswith("kunlun:device_power"):
            continue  # the CPU platform may have no sensor; absent readings are no sample
        assert any(n == family or n.startswith(f"{family}_") for n in names), family
    running = sample(
        scrape(live_server.base_url), "vllm:num_requests_running", model_name=live_server.model_name
    )
    assert running == 0


def test_counters_advance_by_exactly_what_a_request_did(live_server) -> None:
    model = {"model_name": live_server.model_name}
    before = scrape(live_server.base_url)
    body = completion(live_server, max_tokens=5)
    after = scrape(live_server.base_url)

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **model, **labels) - sample(before, name, **model, **labels)

    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:generation_tokens_total") == body["usage"]["completion_tokens"] == 5
    assert delta("vllm:prompt_tokens_total") == body["usage"]["prompt_tokens"]
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") == 4
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:request_generation_tokens_sum") == 5
    assert sample(after, "vllm:kv_cache_usage_perc", **model) == 0
    assert sample(after, "vllm:gpu_cache_usage_perc", **model) == 0


def test_request_params_and_structured_outputs_are_observed_per_request(live_server) -> None:
    model = {"model_name": live_server.model_name}
    before = scrape(live_server.base_url)
    completion(live_server, n=2, max_tokens=3)
    completion(live_server, max_tokens=6, guided_choice=["yes", "no"], ignore_eos=False)
    after = scrape(live_server.base_url)

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **model, **labels) - sample(before, name, **model, **labels)

    assert delta("vllm:request_params_n_count") == 2  # once per API request, not per choice
    assert delta("vllm:request_params_n_sum") == 2 + 1
    assert delta("vllm:request_params_max_tokens_count") == 3  # once per choice
    assert delta("vllm:request_params_max_tokens_sum") == 3 + 3 + 6
    assert delta("kunlun:structured_output_requests_total", kind="choice") == 1
    assert delta("kunlun:structured_output_requests_total", kind="json") == 0
    assert delta("kunlun:structured_output_mask_seconds_total") > 0


def test_metrics_pass_promtool_apart_from_vllms_own_naming(live_server) -> None:
    promtool = shutil.which("promtool") or (REPO / ".tools/bin/promtool")
    if not Path(promtool).exists():
        pytest.skip("promtool not installed (Debian's prometheus package provides it; see fetch-tools)")
    text = httpx.get(f"{live_server.base_url}/metrics").content
    result = subprocess.run([str(promtool), "check", "metrics"], input=text, capture_output=True, timeout=60)
    assert result.returncode in (0, 3), result.stderr.decode()  # 1 would be a parse error, 3 is lint
    problems = [line for line in (result.stdout + result.stderr).decode().splitlines() if line.strip()]
    assert all(any(lint in line for lint in VLLM_NAME_LINTS) for line in problems), problems

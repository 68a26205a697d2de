"""Schemathesis against the server's own OpenAPI document: no generated request gets a 5xx.

Both positive (schema-valid) and negative (schema-violating) requests, for every operation, against
a live server with a short ``max_model_len`` so that no generated request runs long. The amount of
work is bounded by example counts and, as a backstop, by a wall-clock budget after which the
remaining examples are skipped (the assertion itself has no timing in it).
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.generation import GenerationMode

from tests.integration.server.live import LiveServer, serve_in_thread

EXAMPLES_PER_OPERATION = 12
BUDGET_SECONDS = 50.0


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir: Path) -> LiveServer:
    with serve_in_thread(tiny_model_dir, api_key="fuzz-key", max_queue_len=512, max_model_len=64) as server:
        yield server


def fuzz(operation, mode: GenerationMode, server: LiveServer, deadline: float, failures: list[str]) -> int:
    """Run up to EXAMPLES_PER_OPERATION generated requests; returns how many were sent."""
    calls = 0

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def check(case) -> None:
        nonlocal calls
        if time.monotonic() > deadline:
            return
        calls += 1
        response = case.call(base_url=server.base_url, headers=server.headers, timeout=60)
        if response.status_code >= 500:
            failures.append(f"{operation.label} {mode.value}: {response.status_code} {response.text[:300]}")

    try:
        check()
    except Unsatisfiable:  # e.g. no request can violate a schema that has no parameters
        assert mode is GenerationMode.NEGATIVE, operation.label
    return calls


def test_no_generated_request_gets_a_server_error(fuzz_server: LiveServer) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # schemathesis warns about the schema's style; not our subject here
        schema = schemathesis.openapi.from_url(f"{fuzz_server.base_url}/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {
        "/v1/chat/completions",
        "/v1/completions",
        "/tokenize",
        "/health",
    }
    deadline = time.monotonic() + BUDGET_SECONDS
    failures: list[str] = []
    calls = sum(
        fuzz(operation, mode, fuzz_server, deadline, failures)
        for operation in operations
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    )
    assert calls >= len(operations)
    assert failures == []

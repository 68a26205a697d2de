"""An engine loop that fails: requests get a 500 error body, /health turns 503, nothing hangs.

The fault is injected into a real engine (a subclass whose step raises when a marked request is
waiting); everything else, the server included, is the real thing.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from kunlun_runtime.engine.llm_engine import LLMEngine
from tests.integration.server.live import health_status, serve_in_thread
from tests.support.waiting import wait_for

POISON_MAX_TOKENS = 13


class FailingEngine(LLMEngine):
    def step(self):
        if any(r.params.max_tokens == POISON_MAX_TOKENS for r in self.scheduler.waiting):
            raise RuntimeError("injected fault")
        return super().step()


def test_a_failed_engine_answers_500_and_turns_unhealthy(tiny_model_dir: Path) -> None:
    with serve_in_thread(tiny_model_dir, engine_class=FailingEngine) as server:
        body = {"model": server.model_name, "prompt": "x", "max_tokens": POISON_MAX_TOKENS}
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 500
        assert response.json()["error"]["type"] == "InternalServerError"
        assert "injected fault" in response.json()["error"]["message"]
        wait_for(
            lambda: health_status(server.base_url) == 503, timeout_seconds=30.0, message="/health to turn 503"
        )
        later = httpx.post(f"{server.base_url}/v1/completions", json={**body, "max_tokens": 2}, timeout=60)
        assert later.status_code == 503

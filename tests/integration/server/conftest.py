"""Fixtures of the server's integration tests: a tiny chat model and one shared live server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.server.live import API_KEY, LiveServer, serve_in_thread
from tests.support.tiny_models import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-chat")


@pytest.fixture(scope="session")
def live_server(tiny_model_dir: Path) -> Iterator[LiveServer]:
    with serve_in_thread(tiny_model_dir, api_key=API_KEY, max_queue_len=256) as server:
        yield server

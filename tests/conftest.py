"""Suite-wide hooks: under ``KUNLUN_REQUIRE_TOOLS=1`` (CI) a test that skipped because a tool CI
fetches (or a package it installs) is missing is reported as failed, naming it
(tests/support/prerequisites.py).

Other skips (another CPU tier, no GPU, no cluster) stay skips; pytest's ``-ra`` (pyproject's
addopts) lists their reasons at the end of the run.

The image tests (tests/images) run last: CI builds the images in the background while the other
tests run (.ci/run), and the image tests wait for that build (scripts/build-images.sh takes a lock).
"""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path

import pytest

from tests.support.prerequisites import REQUIRE_ENV, missing_tool_named, tools_required

IMAGE_TESTS = Path(__file__).parent / "images"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The image tests last, each group in its collected order."""
    items.sort(key=lambda item: item.path.is_relative_to(IMAGE_TESTS))  # a stable sort


def skip_reason(report: pytest.TestReport) -> str:
    """The reason of a skipped report (pytest keeps it as ``(path, line, "Skipped: reason")``)."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.skipped and not hasattr(report, "wasxfail") and tools_required():
        reason = skip_reason(report)
        tool = missing_tool_named(reason)
        if tool is not None:
            report.outcome = "failed"
            report.longrepr = (
                f"{REQUIRE_ENV}=1: skipped for what CI fetches or installs ({tool}), a failure here: {reason}"
            )
    return report

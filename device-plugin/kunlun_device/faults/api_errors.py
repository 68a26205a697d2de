"""Failed Kubernetes API calls of the fault response: counted, logged once per change, never a flood.

Every failed call is counted by kind (`CALLS`), for the exporter's
`kunlun_xpu_fault_api_errors_total`. A call that keeps failing for the same target (a pod, the Node)
with the same reason is logged once, when it starts failing or its reason changes (e.g. 403 then
unreachable), and once more when it succeeds again; the rounds in between retry it silently.

Invariant: only logging and counting here; the caller retries.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterable

from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError, MaxRetryError

logger = logging.getLogger(__name__)
GET_NODE = "get_node"
PATCH_NODE = "patch_node"
PATCH_POD_STATUS = "patch_pod_status"
CREATE_EVENT = "create_event"
CALLS = (GET_NODE, PATCH_NODE, PATCH_POD_STATUS, CREATE_EVENT)


def describe_api_error(exc: ApiException | HTTPError) -> str:
    """A short, stable reason: `HTTP 403 Forbidden: <the API's message>`, or `unreachable (<error type>)`."""
    if isinstance(exc, ApiException):
        reason = f"HTTP {exc.status} {exc.reason}".rstrip()
        message = _status_message(exc.body)
        return f"{reason}: {message}" if message else reason
    cause = exc.reason if isinstance(exc, MaxRetryError) and exc.reason is not None else exc
    return f"unreachable ({type(cause).__name__})"


def _status_message(body: object) -> str | None:
    """The `message` of a Kubernetes Status body, when the body is one."""
    if isinstance(body, bytes):
        body = body.decode(errors="replace")
    if not isinstance(body, str):
        return None
    try:
        status = json.loads(body)
    except ValueError:
        return None
    message = status.get("message") if isinstance(status, dict) else None
    return message if isinstance(message, str) and message else None


class ApiErrorLog:
    """Counts failed calls and remembers, per (call, target), the reason last logged."""

    def __init__(self) -> None:
        self.errors_total: Counter[str] = Counter({call: 0 for call in CALLS})
        self._failing: dict[tuple[str, str], str] = {}

    def failed(self, call: str, target: str, exc: ApiException | HTTPError, consequence: str) -> None:
        """Count one failure; log it when `target` was not failing, or failed for another reason."""
        self.errors_total[call] += 1
        reason = describe_api_error(exc)
        if self._failing.get((call, target)) == reason:
            return
        self._failing[(call, target)] = reason
        logger.warning("%s %s failed, %s: %s", call, target, consequence, reason)

    def succeeded(self, call: str, target: str) -> None:
        """Note a success; log it when `target` was failing."""
        reason = self._failing.pop((call, target), None)
        if reason is not None:
            logger.info("%s %s succeeded again (it failed with: %s)", call, target, reason)

    def failing(self, call: str) -> list[str]:
        """The targets whose last `call` failed."""
        return sorted(target for c, target in self._failing if c == call)

    def keep_only(self, call: str, targets: Iterable[str]) -> None:
        """Forget failing `call` targets not in `targets` (a pod that is gone is no longer retried)."""
        keep = set(targets)
        self._failing = {(c, t): r for (c, t), r in self._failing.items() if c != call or t in keep}

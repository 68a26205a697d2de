"""The server's door: who is calling and how much they may send, decided before the body is read.

An ASGI middleware in front of every route. In this order, each refusal answered at once with
OpenAI's error body and without reading the request body:

- ``/metrics`` with ``--metrics-token`` set needs ``Authorization: Bearer TOKEN`` (401);
- ``/v1/*``, ``/tokenize`` and ``/detokenize`` need a tenant's API key (401) when any is set;
- a declared ``Content-Length`` over ``--max-request-body-bytes`` is 413.

A body without a declared length (chunked) is counted while it is read; the chunk that crosses the
limit raises ``RequestBodyTooLarge`` (413) into the route that reads it, so at most one limit's
worth of body is ever held. The caller's tenant is left in ``scope["state"]`` for ``tenant_of``.
``/health`` and ``/version`` stay open for probes.
"""

from __future__ import annotations

import hashlib
import secrets

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kunlun_runtime.server.auth import Tenants
from kunlun_runtime.server.errors import error_response

DEFAULT_MAX_REQUEST_BODY_BYTES = 4 << 20
METRICS_PATH = "/metrics"
TENANT_STATE_KEY = "tenant"
_KEYED_PATHS = frozenset({"/tokenize", "/detokenize"})


class RequestBodyTooLarge(StarletteHTTPException):
    """The body grew past the limit while being read (413); FastAPI lets it through unchanged."""

    def __init__(self, max_request_body_bytes: int) -> None:
        super().__init__(413, too_large_message(max_request_body_bytes))


def too_large_message(max_request_body_bytes: int) -> str:
    return f"request body too large: the limit is {max_request_body_bytes} bytes (--max-request-body-bytes)"


def needs_api_key(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/") or path in _KEYED_PATHS


def tenant_of(request: Request) -> str | None:
    """The tenant the door identified for ``request``; None when it did not pass the door."""
    tenant = request.scope.get("state", {}).get(TENANT_STATE_KEY)
    return tenant if isinstance(tenant, str) else None


class Door:
    """The ASGI middleware; see the module docstring for what it refuses and in which order."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        tenants: Tenants,
        max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
        metrics_token: str | None = None,
    ) -> None:
        if max_request_body_bytes < 1:
            raise ValueError("max_request_body_bytes: must be at least 1")
        self.app = app
        self.tenants = tenants
        self.max_request_body_bytes = max_request_body_bytes
        self._metrics_digest = hashlib.sha256(metrics_token.encode()).digest() if metrics_token else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            status_code, message = refusal
            await error_response(status_code, message)(scope, receive, send)
            return
        await self.app(scope, self._counting(receive), send)

    def _refusal(self, scope: Scope) -> tuple[int, str] | None:
        """(status, message) when the request may not come in; records the tenant otherwise."""
        headers = Headers(scope=scope)
        authorization = headers.get("authorization", "")
        path: str = scope["path"]
        if path == METRICS_PATH and not self._metrics_allowed(authorization):
            return 401, "invalid or missing metrics token (Authorization: Bearer ...)"
        tenant = self.tenants.identify(authorization)
        if tenant is None and needs_api_key(path):
            return 401, "invalid or missing API key (Authorization: Bearer ...)"
        scope.setdefault("state", {})[TENANT_STATE_KEY] = tenant
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_request_body_bytes:
            return 413, too_large_message(self.max_request_body_bytes)
        return None

    def _metrics_allowed(self, authorization: str) -> bool:
        if self._metrics_digest is None:
            return True
        presented = hashlib.sha256(authorization.removeprefix("Bearer ").encode()).digest()
        return authorization.startswith("Bearer ") and secrets.compare_digest(presented, self._metrics_digest)

    def _counting(self, receive: Receive) -> Receive:
        limit = self.max_request_body_bytes
        num_received_bytes = 0

        async def counted() -> Message:
            nonlocal num_received_bytes
            message = await receive()
            if message["type"] == "http.request":
                num_received_bytes += len(message.get("body", b""))
                if num_received_bytes > limit:
                    raise RequestBodyTooLarge(limit)
            return message

        return counted

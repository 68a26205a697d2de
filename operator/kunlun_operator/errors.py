"""Errors of the operator, one place for all.

A ``SpecError`` is the user's fault: the custom resource cannot be served as written; it names the
field (``spec.resources.xpus``) and is permanent until the spec changes (mirrored in the status).
An ``ApiError`` is a failed Kubernetes API call; ``retryable`` ones (conflicts, 5xx, throttling,
lost connections) are retried with backoff by the handlers.
"""

from __future__ import annotations


class KunlunOperatorError(Exception):
    """Base class of every error the operator raises on purpose."""


class SpecError(KunlunOperatorError, ValueError):
    """The KunlunInferenceService spec is invalid; ``field`` names the offending field."""

    def __init__(self, field: str, message: str, *, reason: str = "InvalidSpec") -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.reason = reason


class ApiError(KunlunOperatorError):
    """A Kubernetes API call failed with ``status`` (0 when no HTTP answer came back)."""

    RETRYABLE_STATUSES = frozenset({0, 409, 429, 500, 502, 503, 504})

    def __init__(self, status: int, reason: str, message: str, *, call: str) -> None:
        super().__init__(f"{call}: {status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message
        self.call = call

    @property
    def retryable(self) -> bool:
        return self.status in self.RETRYABLE_STATUSES


class OwnershipError(KunlunOperatorError):
    """An object the operator would own already exists and belongs to someone else."""

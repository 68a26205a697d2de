"""Errors of the runtime, one place for all.

An ``InvalidRequestError`` is the caller's fault: it names the offending field and carries the HTTP
status the server answers with. A ``ModelLoadError`` means the model cannot be served as given (it
names the file or the architecture). An ``EngineDeadError`` means the engine cannot continue and
the process should exit and be restarted.
"""


class KunlunRuntimeError(Exception):
    """Base class of every error the runtime raises on purpose."""


class InvalidRequestError(KunlunRuntimeError, ValueError):
    """A request or option is invalid; ``field`` names it, ``status_code`` is the HTTP answer."""

    def __init__(self, message: str, *, field: str | None = None, status_code: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.status_code = status_code


class ModelLoadError(KunlunRuntimeError):
    """A model directory or file cannot be loaded (missing/truncated file, unknown architecture)."""


class ConfigError(KunlunRuntimeError, ValueError):
    """An engine option is invalid or inconsistent; ``field`` names the option."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class EngineDeadError(KunlunRuntimeError):
    """The engine loop failed; the process must exit and be restarted."""

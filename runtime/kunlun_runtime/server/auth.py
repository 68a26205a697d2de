"""Who is calling: API keys → tenants, and the prefix-cache namespace that follows from a tenant.

A tenant is a name with one API key. Keys come from ``--api-keys-file`` (a YAML mapping
``tenant-name: key``) and from the single ``--api-key`` (the tenant ``default``); with no key at all
the server is open and every caller is the one tenant ``default``. Keys are never compared as
strings: the presented key's SHA-256 is compared with every tenant's in constant time, all of them
every time, so neither a key's length nor its position in the file leaks through timing.

The tenant scopes the prefix cache: the engine's salt is ``tenant \\0 client salt``, so a client's
own ``cache_salt`` can only narrow its tenant's cache, never reach another's.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from pathlib import Path

import yaml

from kunlun_runtime.errors import ConfigError

DEFAULT_TENANT = "default"
_SEPARATOR = "\0"


@dataclass(frozen=True, slots=True)
class _Tenant:
    name: str
    key_digest: bytes  # SHA-256 of the key


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class Tenants:
    """The configured tenants; ``identify`` maps an ``Authorization`` header to a tenant name."""

    def __init__(self, keys_by_tenant: dict[str, str] | None = None) -> None:
        keys = keys_by_tenant or {}
        for name, key in keys.items():
            validate_tenant(name, key)
        if len(set(keys.values())) != len(keys):
            raise ConfigError("api keys: two tenants share one key", field="api_keys")
        self._tenants = tuple(_Tenant(name, _digest(key)) for name, key in keys.items())

    @property
    def requires_key(self) -> bool:
        return bool(self._tenants)

    @property
    def num_tenants(self) -> int:
        """Configured tenants; an open server counts as one."""
        return max(1, len(self._tenants))

    def queue_share(self, max_waiting_share: float) -> float | None:
        """The share of the waiting queue one tenant may hold: None (no limit) for a lone tenant."""
        if not 0.0 < max_waiting_share <= 1.0:
            raise ConfigError(
                f"max_waiting_share: {max_waiting_share} is not in (0, 1]", field="max_waiting_share"
            )
        return max_waiting_share if self.num_tenants > 1 else None

    def identify(self, authorization: str) -> str | None:
        """The tenant whose key ``authorization`` (``Bearer KEY``) carries; None for no match.

        An open server (no keys) answers ``DEFAULT_TENANT`` for any header.
        """
        if not self._tenants:
            return DEFAULT_TENANT
        scheme, _, key = authorization.partition(" ")
        presented = _digest(key if scheme.lower() == "bearer" else "")
        found: str | None = None
        for tenant in self._tenants:  # no early exit: every key is compared on every call
            if secrets.compare_digest(presented, tenant.key_digest):
                found = tenant.name
        return found


def validate_tenant(name: object, key: object) -> None:
    """Raises ConfigError unless ``name`` and ``key`` are non-empty strings usable as a tenant."""
    if not isinstance(name, str) or not name or _SEPARATOR in name:
        raise ConfigError(f"api keys: tenant name {name!r} must be a non-empty string", field="api_keys")
    if not isinstance(key, str) or not key.strip():
        raise ConfigError(f"api keys: tenant {name!r}: the key must be a non-empty string", field="api_keys")


def parse_api_keys_file(path: Path) -> dict[str, str]:
    """``{tenant: key}`` from a YAML mapping file; raises ConfigError naming what is wrong."""
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as error:
        raise ConfigError(f"api keys file {path}: {error.strerror}", field="api_keys_file") from error
    except yaml.YAMLError as error:
        raise ConfigError(f"api keys file {path}: not YAML: {error}", field="api_keys_file") from error
    if not isinstance(data, dict) or not data:
        raise ConfigError(f"api keys file {path}: expected a mapping 'tenant: key'", field="api_keys_file")
    for name, key in data.items():
        validate_tenant(name, key)
    return {str(name): str(key) for name, key in data.items()}


def build_tenants(api_key: str | None, api_keys_file: Path | None) -> Tenants:
    """The tenants of ``--api-key`` (as ``default``) and ``--api-keys-file`` together."""
    keys = parse_api_keys_file(api_keys_file) if api_keys_file is not None else {}
    if api_key:
        if DEFAULT_TENANT in keys:
            raise ConfigError(
                f"api keys: --api-key is the tenant {DEFAULT_TENANT!r}, which the file names too",
                field="api_keys_file",
            )
        keys[DEFAULT_TENANT] = api_key
    return Tenants(keys)


def scoped_cache_salt(tenant: str | None, client_salt: str | None) -> str | None:
    """The engine's cache salt: the tenant's namespace, narrowed by the client's own salt.

    ``tenant`` None (a caller outside the HTTP door, e.g. a test) keeps the client's salt as is.
    """
    if tenant is None:
        return client_salt
    return f"{tenant}{_SEPARATOR}{client_salt or ''}"

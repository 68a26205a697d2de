"""Tenants from API keys, the tenant-scoped cache salt, and each tenant's share of the waiting queue."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from kunlun_runtime.errors import ConfigError
from kunlun_runtime.server.auth import (
    DEFAULT_TENANT,
    Tenants,
    build_tenants,
    parse_api_keys_file,
    scoped_cache_salt,
)
from kunlun_runtime.server.errors import QueueFullError
from kunlun_runtime.server.fair_share import WaitingShares


def make_keys_file(directory: Path, text: str) -> Path:
    path = directory / "keys.yaml"
    path.write_text(text)
    return path


def test_each_key_identifies_its_own_tenant_and_anything_else_none() -> None:
    tenants = Tenants({"alice": "key-a", "bob": "key-b"})
    assert tenants.identify("Bearer key-a") == "alice"
    assert tenants.identify("bearer key-b") == "bob"
    assert tenants.identify("Bearer key-") is None
    assert tenants.identify("Bearer key-a ") is None
    assert tenants.identify("Basic key-a") is None
    assert tenants.identify("") is None
    assert tenants.requires_key and tenants.num_tenants == 2


def test_an_open_server_is_one_tenant_whatever_the_header() -> None:
    tenants = Tenants()
    assert not tenants.requires_key
    assert tenants.identify("") == tenants.identify("Bearer anything") == DEFAULT_TENANT
    assert tenants.num_tenants == 1


def test_the_keys_file_and_the_single_key_make_one_set_of_tenants(tmp_path: Path) -> None:
    path = make_keys_file(tmp_path, "alice: key-a\nbob: key-b\n")
    assert parse_api_keys_file(path) == {"alice": "key-a", "bob": "key-b"}
    tenants = build_tenants("key-d", path)
    assert [tenants.identify(f"Bearer key-{x}") for x in "abd"] == ["alice", "bob", DEFAULT_TENANT]


@pytest.mark.parametrize(
    "text",
    ["- key-a\n", "alice:\n", "alice: ''\n", "{}\n", "alice: [1]\n", "alice: key\nbob: key\n", ": x: y"],
)
def test_a_malformed_keys_file_is_a_config_error_naming_the_option(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError) as error:
        build_tenants(None, make_keys_file(tmp_path, text))
    assert error.value.field in ("api_keys_file", "api_keys")


def test_the_single_key_may_not_reuse_the_default_tenant_of_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="default"):
        build_tenants("key-x", make_keys_file(tmp_path, "default: key-a\n"))


def test_the_cache_salt_is_the_tenant_narrowed_by_the_client_salt() -> None:
    assert scoped_cache_salt("alice", None) == "alice\0"
    assert scoped_cache_salt("alice", "s") == "alice\0s"
    # a client cannot name its way into another tenant's namespace
    assert scoped_cache_salt("bob", "alice\0") != scoped_cache_salt("alice", None)
    assert scoped_cache_salt(None, "s") == "s"


def test_the_queue_share_applies_only_with_several_tenants() -> None:
    assert Tenants({"alice": "a", "bob": "b"}).queue_share(0.5) == 0.5
    assert Tenants({"alice": "a"}).queue_share(0.5) is None
    with pytest.raises(ConfigError) as error:
        Tenants().queue_share(0.0)
    assert error.value.field == "max_waiting_share"


def test_a_tenant_is_refused_past_its_share_and_others_are_not() -> None:
    shares = WaitingShares(0.5, 8)
    assert shares.limit == 4
    shares.admit("alice", 3)
    with pytest.raises(QueueFullError, match=r"--max-waiting-share 0\.5"):
        shares.admit("alice", 2)
    shares.admit("alice", 1)
    shares.admit("bob", 4)
    with pytest.raises(QueueFullError):
        shares.admit("bob", 1)


def test_taken_in_requests_count_while_they_wait_and_stop_counting_once_scheduled() -> None:
    shares = WaitingShares(0.5, 4)
    shares.admit("alice", 2)
    shares.taken_in("alice", 2)
    for request_id in ("r1", "r2"):
        shares.track(request_id, "alice")
    waiting = shares.count_waiting(["r1", "r2", "someone-untracked"])
    assert waiting == Counter({"alice": 2})
    shares.set_waiting(waiting)
    with pytest.raises(QueueFullError):
        shares.admit("alice", 1)
    shares.forget("r1")
    shares.set_waiting(shares.count_waiting(["r2"]))  # r1 finished, r2 still waits
    shares.admit("alice", 1)


def test_without_a_share_nothing_is_refused_or_tracked() -> None:
    shares = WaitingShares(None, 4)
    shares.admit("alice", 100)
    shares.track("r1", "alice")
    assert shares.count_waiting(["r1"]) == Counter()


def test_the_keys_file_of_the_server_guide_parses(tmp_path: Path) -> None:
    guide = Path(__file__).resolve().parents[3] / "docs" / "server.md"
    [block] = re.findall(r"```yaml\n(.*?)```", guide.read_text(), flags=re.DOTALL)
    tenants = build_tenants(None, make_keys_file(tmp_path, block))
    assert tenants.num_tenants == 2

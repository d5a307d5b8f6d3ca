"""The ACL rules of shared.acl and the role credentials of Settings (no server)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from shared.acl import client_subcommands, password_hash, rules, user_lines
from shared.settings import load_settings


def test_the_producer_may_run_only_listed_commands_on_its_keys() -> None:
    r = rules("producer")
    assert "-@all" in r and "+@all" not in r
    assert "~*" not in r and "&*" not in r  # no key or channel beyond its own
    for forbidden in ("+eval", "+evalsha", "+config", "+flushall", "+shutdown", "+keys"):
        assert forbidden not in r
    assert {"+lpush", "+get", "+subscribe", "~text*", "~celery-task-meta-*"} <= set(r)
    assert "+wait" in r  # behind Sentinel a publish waits for a replica (shared.ha)
    assert "+time" in r  # Redis' clock stamps submit times and deadlines (shared.clock)
    assert "+info" in r  # ioredis' ready check: celery-node connects with default options
    # resets come before the grants they scope
    assert r.index("resetkeys") < r.index("~text*")
    assert r.index("resetchannels") < r.index("&celery-task-meta-*")


def test_event_channels_follow_the_database() -> None:
    assert "&/3.celeryev/*" in rules("producer", db=3)


def test_workers_and_operators_lose_the_dangerous_commands() -> None:
    for role in ("worker", "operator"):
        assert "-@dangerous" in rules(role)
    assert "-@dangerous" not in rules("admin")


def test_client_subcommands_fit_each_server_version() -> None:
    # Redis 7.0/7.1 refuse a rule naming client|setinfo (7.2 added it): it must not appear
    assert "client|setinfo" not in client_subcommands((7, 0))
    assert "client|setinfo" in client_subcommands((7, 4))
    assert "client|maint_notifications" in client_subcommands((6, 2))
    # Redis 7 classifies CLIENT subcommands itself: no explicit grant for workers there
    assert not any(x.startswith("+client|") for x in rules("worker", version=(7, 4)))
    assert "+client|setname" in rules("worker", version=(6, 2))


def test_unknown_role_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown Redis role 'guest'"):
        rules("guest")


def test_user_lines_store_hashes_and_map_admin_to_default() -> None:
    lines = user_lines({"admin": "s3cret", "producer": "p4ss"})
    assert lines[0].startswith("user default reset on #")
    assert lines[1].startswith("user producer reset on #")
    assert not any("s3cret" in line or "p4ss" in line for line in lines)
    assert password_hash("s3cret") == "#" + hashlib.sha256(b"s3cret").hexdigest()


def test_each_role_reads_its_own_password_file(tmp_path: Path) -> None:
    for name, value in (("redis.password", "adm"), ("redis-producer.password", "prod")):
        (tmp_path / name).write_text(value + "\n")
    s = load_settings(stack={"run_dir": tmp_path})
    assert s.redis_credentials("admin") == (None, "adm")
    assert s.redis_credentials("producer") == ("producer", "prod")
    assert s.redis_url("producer").startswith("redis://producer:prod@")
    with pytest.raises(FileNotFoundError):
        s.redis_credentials("worker")  # `fleet up` was not run for it


def test_explicit_credentials_win_for_every_role(tmp_path: Path) -> None:
    s = load_settings(stack={"run_dir": tmp_path}, redis={"user": "svc", "password": "pw"})
    assert s.redis_credentials("producer") == ("svc", "pw")
    assert s.redis_credentials("admin") == ("svc", "pw")

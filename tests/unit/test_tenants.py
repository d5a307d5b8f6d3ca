"""Tenants as pure logic: names and settings, which tenant a gateway request is for (the token
binds it), the take's weighted turns between tenant lists, and the quota's check and release
commands (``shared.tenants``, ``shared.tenant_quota``, ``producer.gateway.tenancy``,
``producer.gateway.auth``, ``workers.consumer.tenant_turns``)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from pydantic import ValidationError

from producer.client.wire import Outgoing
from producer.gateway.auth import bearer_tenant
from producer.gateway.errors import TenantForbidden, Unauthorized
from producer.gateway.tenancy import request_tenant
from shared import tenant_quota, tenants
from shared.errors import InvalidInput, TenantQuota
from shared.settings import load_settings
from workers.consumer.tenant_turns import TenantTurns, tenant_transport_options


def test_tenant_settings_are_typed_and_unknown_keys_refused() -> None:
    s = load_settings(tenants={"acme": {"max_queued": 5, "weight": 2}})
    assert s.tenants["acme"].max_queued == 5 and s.tenants["acme"].weight == 2.0
    assert s.tenancy.share == "fair" and s.tenancy.default_tenant == "default"
    for bad in (
        {"acme": {"max_queud": 5}},
        {"acme": {"weight": 0}},
        {"acme": {"max_queued": 0}},
        {"bad name": {}},
    ):
        with pytest.raises(ValidationError):
            load_settings(tenants=bad)
    with pytest.raises(ValidationError):
        load_settings(tenancy={"share": "random"})


def test_tenant_names() -> None:
    assert tenants.check_name("acme-1.b_2") == "acme-1.b_2"
    for bad in ("", "-x", "a b", "x" * 65, 3, "a\x1fb"):
        with pytest.raises(InvalidInput):
            tenants.check_name(bad)


def test_only_configured_tenants_have_lists_and_only_in_fair_mode() -> None:
    s = load_settings(tenants={"acme": {}, "default": {"weight": 2}})
    assert tenants.has_own_list(s, "acme")
    assert not tenants.has_own_list(s, "stranger")  # not configured: the shared list
    assert not tenants.has_own_list(s, None) and not tenants.has_own_list(s, "default")
    fifo = load_settings(tenants={"acme": {}}, tenancy={"share": "fifo"})
    assert not tenants.has_own_list(fifo, "acme")
    key = tenants.tenant_list_key("text", 9, "acme")
    assert key == "text\x06\x169\x1facme"
    assert key.rsplit("\x06\x16", 1)[0] == "text"  # the worker reads the queue back
    assert tenants.tenant_list_key("text.realtime", 0, "acme").rsplit("\x06\x16", 1)[0] == (
        "text.realtime"
    )
    assert tenants.tenant_lists(s, "text", 9) == [key]


def test_a_token_bound_to_a_tenant_cannot_name_another() -> None:
    assert request_tenant("acme", None, None) == "acme"
    assert request_tenant("acme", "acme", "acme") == "acme"
    with pytest.raises(TenantForbidden):
        request_tenant("acme", "other", None)
    with pytest.raises(TenantForbidden):
        request_tenant("acme", None, "other")
    assert request_tenant(None, "other", None) == "other"
    assert request_tenant(None, None, "other") == "other"
    assert request_tenant(None, None, None) is None
    with pytest.raises(InvalidInput):
        request_tenant(None, "a", "b")
    with pytest.raises(InvalidInput):
        request_tenant(None, None, 7)


def test_bearer_tokens_map_to_their_tenant() -> None:
    tokens = {"acme": "acme-token-0123456789", "other": "other-token-0123456789"}
    assert bearer_tenant("Bearer main-token", "main-token", tokens) is None
    assert bearer_tenant("Bearer acme-token-0123456789", "main-token", tokens) == "acme"
    assert bearer_tenant("bearer other-token-0123456789", "main-token", tokens) == "other"
    for bad in (None, "Bearer nope", "Basic acme-token-0123456789"):
        with pytest.raises(Unauthorized):
            bearer_tenant(bad, "main-token", tokens)


def test_weighted_turns_start_takes_in_proportion() -> None:
    turns = TenantTurns(("a", "b"), {"": 1.0, "a": 1.0, "b": 2.0})
    firsts = Counter(turns.next("text", 9)[0] for _ in range(40))
    base, a, b = turns.lists("text", 9)
    assert base == "text\x06\x169"
    assert (firsts[base], firsts[a], firsts[b]) == (10, 10, 20)
    order = turns.next("text", 9)
    assert sorted(order) == sorted([base, a, b])  # every list, in rotation


def test_transport_options_name_the_tenant_lists() -> None:
    assert tenant_transport_options(load_settings()) == {}
    s = load_settings(tenants={"b": {"weight": 3}, "a": {}, "default": {"weight": 2}})
    opts = tenant_transport_options(s)
    assert opts["tenant_names"] == ("a", "b")
    assert opts["tenant_weights"][""] == 2.0 and opts["tenant_weights"]["b"] == 3.0


def out(key: str, quota: Any) -> Outgoing:
    return Outgoing(key, b"{}", None, quota)


def test_the_quota_check_counts_new_ids_only() -> None:
    part = [out("text", ("fleet:tenant:acme:open", 3, i)) for i in ("x", "y")]
    part.append(out("text", None))
    sets = tenant_quota.sets_of(part)
    assert sets == {"fleet:tenant:acme:open": (3, ["x", "y"])}
    assert tenant_quota.check_commands(sets) == [
        ("WATCH", "fleet:tenant:acme:open"),
        ("SCARD", "fleet:tenant:acme:open"),
        ("SMISMEMBER", "fleet:tenant:acme:open", "x", "y"),
    ]
    tenant_quota.judge(sets, ["OK", 1, [0, 0]])  # 1 + 2 new = 3: fits
    tenant_quota.judge(sets, ["OK", 3, [1, 1]])  # both held already (a chunk sent again)
    tenant_quota.judge(sets, ["OK", 2, [1, 0]])  # 2 + 1 new = 3: fits
    with pytest.raises(TenantQuota) as refused:
        tenant_quota.judge(sets, ["OK", 3, [1, 0]])  # 3 + 1 new > 3
    assert "acme" in str(refused.value) and refused.value.code == "TENANT_QUOTA"
    assert tenant_quota.add_commands(part) == [("SADD", "fleet:tenant:acme:open", "x", "y")]


def test_a_retry_tells_an_applied_push_by_its_new_ids() -> None:
    a, b = "fleet:tenant:acme:open", "fleet:tenant:beta:open"
    sets = {a: (9, ["x", "y"]), b: (9, ["z"])}
    # the first check: x was held already (sent before under this id), y and z are new
    first = ["OK", 4, [1, 0], 0, [0]]
    fresh = tenant_quota.absent(sets, first)
    assert fresh == ["y", "z"]
    assert tenant_quota.recheck_commands(sets, fresh)[-1] == (
        "EXISTS",
        "celery-task-meta-y",
        "celery-task-meta-z",
    )
    # the lost EXEC did not run: x alone held, no result -> not applied, judged as before
    assert not tenant_quota.applied(sets, fresh, ["OK", 4, [1, 0], 0, [0], 0])
    # it ran: its new ids are in their sets
    assert tenant_quota.applied(sets, fresh, ["OK", 5, [1, 1], 1, [1], 0])
    # it ran and a worker has already released them: their results are stored
    assert tenant_quota.applied(sets, fresh, ["OK", 3, [0, 0], 0, [0], 2])
    # x being held says nothing (it was before the EXEC), nor does anything without new ids
    assert not tenant_quota.applied(sets, [], ["OK", 4, [1, 0], 0, [0]])


def test_a_cancel_releases_the_id_from_every_limited_tenants_set() -> None:
    from celery import Celery

    from producer.client.results import Revocation

    s = load_settings(tenants={"acme": {"max_queued": 5}, "beta": {"max_queued": 9}, "c": {}})
    app = Celery("cancel-test", backend="cache+memory://", set_as_current=False)
    commands = Revocation.of(app, s, "id-1", "no longer wanted").commands()
    assert [c[0] for c in commands] == ["SETEX", "SET", "PUBLISH", "SREM", "SREM"]
    assert commands[3:] == [
        ("SREM", "fleet:tenant:acme:open", "id-1"),
        ("SREM", "fleet:tenant:beta:open", "id-1"),
    ]
    plain = load_settings(tenants={"c": {"weight": 2}})  # no max_queued: nothing to release
    assert [c[0] for c in Revocation.of(app, plain, "id-1", "r").commands()][3:] == []


def test_release_names_only_limited_tenants() -> None:
    s = load_settings(tenants={"acme": {"max_queued": 5}, "free": {}})
    kw = [
        ("1", {"request": {"tenant": "acme"}}),
        ("2", {"request": {"tenant": "free"}}),
        ("3", {"request": {"tenant": None}}),
        ("4", {"request": {"tenant": "acme"}}),
    ]
    assert tenant_quota.release_commands(s, kw) == [("SREM", "fleet:tenant:acme:open", "1", "4")]
    assert tenant_quota.release_commands(load_settings(), kw) == []
    limited_default = load_settings(tenants={"default": {"max_queued": 5}})
    assert tenant_quota.release_commands(limited_default, kw) == [
        ("SREM", "fleet:tenant:default:open", "3")
    ]
    assert tenant_quota.quota_of(s, "free", "x") is None
    assert tenant_quota.quota_of(s, "acme", "x") == ("fleet:tenant:acme:open", 5, "x")


def test_the_take_starts_with_the_list_the_window_holds_fewest_of() -> None:
    turns = TenantTurns(("a", "b"), {"": 1.0, "a": 1.0, "b": 1.0})
    _, a, b = turns.lists("text", 9)
    for i in range(200):
        turns.taken(a, f"t{i}")
    for i in range(10):
        turns.taken(b, f"u{i}")
    order = turns.next("text", 9)
    assert order.index(b) < order.index(a)  # b's list first while the window is a's
    turns.forget({f"t{i}" for i in range(5)} | {f"u{i}" for i in range(10)})
    order = turns.next("text", 9)
    assert order[-1] == b  # now b holds more than a (10 against 5)

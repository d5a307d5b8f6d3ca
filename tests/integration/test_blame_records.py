"""Poison accounting's blame records on a real Redis (``workers.batching.admission.InFlight``,
its scripts ``blame_arrive.lua`` and ``inflight_begin.lua``), as the worker's ACL user: a dead
incarnation's record counts for a redelivered message only, own records never, expired
records leave the index, decoded and released ids leave the records, and the gate is one
script call per batch.

The pure bookkeeping: tests/unit/test_blame_book.py; real worker deaths:
tests/integration/test_faults.py.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from shared import schema
from tests.conftest import own_redis as own_redis_stack
from workers.batching.admission import FINAL, InFlight

pytestmark = pytest.mark.integration

TTL_S = 600


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with own_redis_stack(tmp_path_factory, "blame") as st:
        yield st


@pytest.fixture()
def admin(own_redis: Any) -> redis.Redis:
    return redis.Redis.from_url(own_redis.s.redis_url("admin"))


def worker(own_redis: Any, name: str | None = None, ttl_s: int = TTL_S) -> InFlight:
    """One worker process incarnation (a new name each: its own records)."""
    client = redis.Redis.from_url(own_redis.s.redis_url("worker"))
    return InFlight(client, ttl_s, name=name or f"host:{uuid.uuid4().hex[:8]}:t")


def ids(n: int) -> list[str]:
    return [str(uuid.uuid4()) for _ in range(n)]


def _calls(admin: redis.Redis) -> dict[str, int]:
    stats = admin.info("commandstats")
    return {k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items()}


def test_a_dead_incarnations_record_counts_for_a_redelivered_message_only(
    own_redis: Any, admin: redis.Redis
) -> None:
    x, y, z = ids(3)
    dead = worker(own_redis)
    assert dead.arrive([x, y, z], [False, False, False]) == [1, 1, 1]
    dead.uncount([x, y, z])  # decoded: out of the decode record
    assert dead.begin([x, y]) == [1, 1]  # running x and y when it dies
    assert admin.get(dead.book.key("lane-1")) == f"{x} {y}".encode()
    assert admin.sismember(schema.BLAME_INDEX_KEY, dead.book.key("lane-1"))
    alive = worker(own_redis)
    # x redelivered: one death; y not marked redelivered: not looked up; z only waited
    assert alive.arrive([x, y, z], [True, False, True]) == [2, 1, 1]
    third = worker(own_redis)  # alive's decode record names x too: it is decoding it now
    assert third.arrive([x], [True]) == [3]
    alive.uncount([x, y, z])
    assert third.arrive([x], [True]) == [2]


def test_own_records_never_count_and_an_incarnation_counts_once(
    own_redis: Any, admin: redis.Redis
) -> None:
    [x] = ids(1)
    me = worker(own_redis)
    me.arrive([x], [False])  # its decode record is left naming x (as if emptying failed)
    me.begin([x])
    assert me.arrive([x], [True]) == [1]  # its lease lapsed and x came back to it: no death
    assert worker(own_redis).arrive([x], [True]) == [2]  # two records, one incarnation


def test_expired_records_are_dropped_from_the_index(own_redis: Any, admin: redis.Redis) -> None:
    [x] = ids(1)
    short = worker(own_redis, ttl_s=1)
    short.arrive([x], [False])
    key = short.book.key("decode")
    assert admin.sismember(schema.BLAME_INDEX_KEY, key)
    time.sleep(1.2)
    assert worker(own_redis).arrive([x], [True]) == [1]
    assert not admin.sismember(schema.BLAME_INDEX_KEY, key)
    short.arrive([x], [False])  # written again after it may have expired: indexed again
    assert admin.sismember(schema.BLAME_INDEX_KEY, key)


def test_decoded_and_released_ids_leave_the_records(own_redis: Any, admin: redis.Redis) -> None:
    a, b, c = ids(3)
    w = worker(own_redis)
    w.arrive([a, b, c], [False] * 3)
    w.uncount([a])  # a decoded; b and c still decoding
    assert admin.get(w.book.key("decode")) == f"{b} {c}".encode()
    w.uncount([b, c])
    assert admin.get(w.book.key("decode")) == b""  # emptied, not deleted: its name stays valid
    w.begin([a, b])
    w.uncount([b])  # a shutdown gave b back unrun
    assert admin.get(w.book.key("lane-1")) == a.encode()
    assert worker(own_redis).arrive([a, b, c], [True] * 3) == [2, 1, 1]


def test_the_gate_is_one_script_call_that_records_only_what_runs(
    own_redis: Any, admin: redis.Redis
) -> None:
    done, new = ids(2)
    w = worker(own_redis)
    w.begin([new])  # the script is loaded and the record indexed by now
    admin.set(schema.final_key(done), 1)
    admin.config_resetstat()
    assert w.begin([done, new]) == [FINAL, 1]
    calls = _calls(admin)
    assert calls.pop("evalsha") == 1 and calls.pop("set") == 1 and calls.pop("exists") == 2
    assert set(calls) <= {"config|resetstat", "config"}, calls
    assert admin.get(w.book.key("lane-1")) == new.encode()
    assert worker(own_redis).arrive([done, new], [True, True]) == [1, 2]


def test_an_arrival_without_redeliveries_is_one_set(own_redis: Any, admin: redis.Redis) -> None:
    w = worker(own_redis)
    w.arrive(ids(1), [False])  # indexed by now
    admin.config_resetstat()
    w.arrive(ids(8), [False] * 8)
    w.uncount(list(w.book.slots["decode"]))
    calls = _calls(admin)
    assert calls.pop("set") == 2, calls
    assert set(calls) <= {"config|resetstat", "config"}, calls


def test_a_retired_incarnation_leaves_no_record(own_redis: Any, admin: redis.Redis) -> None:
    [x] = ids(1)
    w = worker(own_redis)
    w.arrive([x], [False])
    w.begin([x])
    keys = [w.book.key("decode"), w.book.key("lane-1")]
    w.retire()
    assert admin.exists(*keys) == 0
    assert not any(admin.sismember(schema.BLAME_INDEX_KEY, k) for k in keys)
    assert worker(own_redis).arrive([x], [True]) == [1]

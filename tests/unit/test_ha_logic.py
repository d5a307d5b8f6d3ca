"""Redis high availability without servers: the WAIT policy, the Celery options, the
configuration files `fleet up --ha` writes, the recorded sentinels."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from producer.stack import sentinel
from producer.stack.local import Stack
from shared.celery_app import make_app, sentinel_options, wait_options
from shared.redis_client import Waiter
from shared.settings import load_settings

SENTINELS = ["127.0.0.1:26401", "127.0.0.1:26402", "127.0.0.1:26403"]


pytestmark = pytest.mark.usefixtures("no_fleet_env")  # FLEET_* from the shell must not leak in


def ha_settings(tmp_path: Path, **redis: object):
    for name in ("redis.password", "redis-producer.password", "redis-worker.password"):
        (tmp_path / name).write_text(f"pw-{name}\n")
    (tmp_path / "redis-operator.password").write_text("pw-op\n")
    (tmp_path / "redis-sentinel.password").write_text("pw-sentinel\n")
    return load_settings(
        stack={"run_dir": tmp_path}, redis={"port": 6500, "sentinels": SENTINELS, **redis}
    )


def test_a_short_wait_on_the_primary_pauses_waiting_for_the_backoff() -> None:
    w = Waiter(replicas=1, timeout_ms=250, backoff_s=2.0)
    assert w.due(now=100.0) and w.args() == ("WAIT", 1, 250)
    assert w.enough(1) and w.enough(2) and not w.enough(0) and not w.enough(None)
    w.short_answer(primary=True, now=100.0)
    assert not w.due(now=101.9)
    assert w.due(now=102.1)
    assert (w.short, w.uncertain) == (1, 0)


def test_a_short_wait_on_a_node_no_longer_primary_keeps_waiting() -> None:
    w = Waiter(replicas=1, timeout_ms=250)
    w.short_answer(primary=False, now=100.0)
    assert w.due(now=100.0)  # the retry must wait for a replica again
    assert (w.short, w.uncertain) == (1, 1)


def test_no_waiter_without_sentinels_or_with_wait_off(tmp_path: Path) -> None:
    assert Waiter.of(load_settings()) is None
    assert Waiter.of(ha_settings(tmp_path, wait_replicas=0)) is None
    w = Waiter.of(ha_settings(tmp_path, wait_timeout_ms=100))
    assert w is not None and w.args() == ("WAIT", 1, 100)


def test_the_celery_app_uses_the_sentinel_transports_and_backend(tmp_path: Path) -> None:
    s = ha_settings(tmp_path)
    app = make_app(s, role="producer")
    assert app.conf.broker_transport == "shared.ha:ProducerSentinelTransport"
    assert str(app.conf.broker_url).startswith("sentinel://producer:")
    opts = app.conf.broker_transport_options
    assert opts["master_name"] == "mmfleet"
    assert opts["sentinel_kwargs"]["password"] == "pw-sentinel"
    assert (opts["wait_replicas"], opts["wait_timeout_ms"]) == (1, 250)
    assert app.conf.result_backend_transport_options["master_name"] == "mmfleet"
    assert type(app.backend).__name__ == "SentinelBackend"


def test_without_sentinels_the_celery_app_is_unchanged() -> None:
    s = load_settings(redis={"password": "pw"})
    app = make_app(s, role="producer")
    assert sentinel_options(s) == {} and wait_options(s) == {}
    assert "master_name" not in app.conf.broker_transport_options
    assert app.conf.broker_transport == "shared.kombu_redis:Transport"  # refusals apart
    assert not make_app(s, role="worker").conf.broker_transport  # workers set their own
    assert type(app.backend).__name__ == "RedisBackend"


def test_both_data_nodes_get_users_notifications_and_replication_auth(tmp_path: Path) -> None:
    st = Stack(ha_settings(tmp_path))
    st.prepare()
    primary = sentinel.node_conf(st, "redis", (6, 2), None).splitlines()
    replica = sentinel.node_conf(st, "redis-replica", (6, 2), ("127.0.0.1", 6500)).splitlines()
    for conf in (primary, replica):
        assert "notify-keyspace-events Kl" in conf and "appendonly yes" in conf
        assert "masterauth pw-redis.password" in conf  # either node may replicate later
        assert sum(ln.startswith("user ") for ln in conf) == 4  # ACL is not replicated
        assert not any("pw-redis-producer" in ln for ln in conf)  # hashes only
    assert "port 6500" in primary and "port 6501" in replica
    assert "replicaof 127.0.0.1 6500" in replica
    assert not any(ln.startswith("replicaof") for ln in primary)


def test_sentinels_get_their_password_quorum_and_the_admins_auth(tmp_path: Path) -> None:
    st = Stack(ha_settings(tmp_path, sentinel_down_after_ms=1000))
    st.prepare()
    conf = sentinel.sentinel_conf(st, 1, ("127.0.0.1", 6500)).splitlines()
    assert "port 26402" in conf
    assert "requirepass pw-sentinel" in conf and "sentinel sentinel-pass pw-sentinel" in conf
    assert "sentinel monitor mmfleet 127.0.0.1 6500 2" in conf
    assert "sentinel down-after-milliseconds mmfleet 1000" in conf
    assert "sentinel auth-pass mmfleet pw-redis.password" in conf


def test_the_stack_records_its_sentinels_for_later_commands(tmp_path: Path) -> None:
    st = Stack(ha_settings(tmp_path))
    env = st.recorded_env()
    assert json.loads(env["FLEET_REDIS__SENTINELS"]) == SENTINELS
    assert "FLEET_REDIS__SENTINELS" not in Stack(load_settings()).recorded_env()


def test_down_stops_sentinels_then_the_replica_then_the_primary(tmp_path: Path) -> None:
    st = Stack(ha_settings(tmp_path))
    st.prepare()
    for name in ("redis", "redis-replica", "sentinel-0", "sentinel-1", "worker-text"):
        (st.pids / f"{name}.pid").write_text("999999999")  # no such process
    assert st.down() == ["worker-text", "sentinel-0", "sentinel-1", "redis-replica", "redis"]


def test_the_gateways_async_client_follows_the_sentinels(tmp_path: Path) -> None:
    from redis.asyncio.sentinel import SentinelConnectionPool

    from shared.redis_client import async_redis_client

    client = async_redis_client(ha_settings(tmp_path), "producer", max_connections=64)
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool)
    assert pool.service_name == "mmfleet" and pool.max_connections == 64
    assert pool.connection_kwargs["username"] == "producer"


def test_workers_take_batches_on_sentinel_pools() -> None:
    from kombu.transport import redis as kombu_redis

    from shared.ha import WaitingPut
    from workers.consumer import channel
    from workers.consumer.sentinel import SentinelChannel

    mro = SentinelChannel.__mro__
    assert (
        mro.index(WaitingPut) < mro.index(kombu_redis.SentinelChannel) < mro.index(channel.Channel)
    )
    opts = set(SentinelChannel.from_transport_options)
    assert {
        "fetch_limit",
        "fetch_notify",
        "master_name",
        "sentinel_kwargs",
        "wait_replicas",
    } <= opts


@pytest.fixture()
def _restore_sentinel_alias() -> Iterator[None]:
    from kombu import transport as kombu_transport

    alias = kombu_transport.TRANSPORT_ALIASES["sentinel"]
    yield
    kombu_transport.TRANSPORT_ALIASES["sentinel"] = alias
    kombu_transport._transport_cache.pop("sentinel", None)


@pytest.mark.usefixtures("_restore_sentinel_alias")
def test_a_producer_connection_keeps_waiting_publishes_after_kombu_switches_sentinel(
    tmp_path: Path,
) -> None:
    """kombu takes the ``;``-joined sentinel URLs for failover alternates, and its switch to
    the next one after a connection error re-derives the transport from the URL's scheme:
    the producer's publishes then went out without ``WAIT`` (lost in ``SENTINEL FAILOVER``)."""
    from shared.ha import SentinelTransport, WaitingPut

    app = make_app(ha_settings(tmp_path), role="producer")
    with app.connection_for_write() as conn:
        assert isinstance(conn.transport, SentinelTransport)
        conn.maybe_switch_next()  # what ensure_connection does after a failed attempt
        assert conn.port == 26402
        assert isinstance(conn.transport, SentinelTransport)
        assert issubclass(conn.transport.Channel, WaitingPut)


@pytest.mark.usefixtures("_restore_sentinel_alias")
def test_a_worker_connection_keeps_its_fetch_and_leases_after_a_switch(tmp_path: Path) -> None:
    from kombu import Connection

    from shared.ha import pin_sentinel_transport
    from workers.consumer.sentinel import SentinelTransport as WorkerSentinel

    s = ha_settings(tmp_path)
    pin_sentinel_transport("workers.consumer.sentinel:SentinelTransport")
    make_app(s, role="producer")  # a producer app in the worker's process: the worker's stays
    conn = Connection(
        s.redis_url("worker"), transport="workers.consumer.sentinel:SentinelTransport"
    )
    for _ in range(3):
        conn.maybe_switch_next()
        assert isinstance(conn.transport, WorkerSentinel)

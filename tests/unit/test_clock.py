"""``shared.clock.RedisClock`` and ``workers.consumer.clock_watch`` on fake clocks (no Redis):
Redis'
time between samples, when a sample is taken, which one is adopted, the skew and its report."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from kombu.transport import redis as kombu_redis

from shared import clock as shared_clock
from shared.clock import RETRY_S, RedisClock, seconds_of
from workers.consumer import clock_watch

HOUR = 3600.0


class Host:
    """A host's wall and monotonic clocks and a Redis whose ``TIME`` is ``true + redis_off``;
    each ``TIME`` takes ``rtt`` seconds of the host's clocks (the reply is read halfway)."""

    def __init__(self, wall_off: float = 0.0, rtt: float = 0.002) -> None:
        self.true = 1_764_460_800.0  # real time
        self.mono_off = -1_764_460_000.0  # monotonic: since boot
        self.wall_off = wall_off
        self.rtt = rtt
        self.reads = 0
        self.fail = False

    def wall(self) -> float:
        return self.true + self.wall_off

    def mono(self) -> float:
        return self.true + self.mono_off

    def time_reply(self) -> tuple[int, int]:
        self.reads += 1
        if self.fail:
            raise ConnectionError("Redis away")
        self.true += self.rtt / 2
        sec, usec = divmod(round(self.true * 1e6), 1_000_000)
        self.true += self.rtt / 2
        return sec, usec

    def clock(self, refresh_s: float = 15.0) -> RedisClock:
        return RedisClock(self.time_reply, refresh_s, wall=self.wall, mono=self.mono)


def test_time_replies_parse_in_every_form_redis_py_returns() -> None:
    assert seconds_of((1764460800, 250000)) == 1764460800.25
    assert seconds_of([b"1764460800", b"500000"]) == 1764460800.5
    with pytest.raises(ValueError, match="not a TIME reply"):
        seconds_of(b"OK")


def test_a_clock_an_hour_off_reads_redis_time_and_reports_its_skew() -> None:
    for off in (HOUR, -HOUR):
        host = Host(wall_off=off)
        c = host.clock()
        assert c.now() == pytest.approx(host.true, abs=0.002)
        assert c.skew_s == pytest.approx(off, abs=0.002)
        host.true += 7.5  # later, between samples: advanced on the monotonic clock
        assert c.peek() == pytest.approx(host.true, abs=0.002)


def test_until_a_first_sample_the_local_wall_clock_stands_in() -> None:
    host = Host(wall_off=HOUR)
    c = host.clock()
    assert not c.sampled and c.skew_s is None
    assert c.peek() == host.wall()  # peek never asks Redis
    assert host.reads == 0


def test_one_round_trip_per_refresh_period_not_per_call() -> None:
    host = Host()
    c = host.clock(refresh_s=15.0)
    for _ in range(1000):
        c.now()
        host.true += 0.001  # 1000 calls in 1 s
    assert host.reads == 1
    host.true += 14.5
    c.now()
    assert host.reads == 2  # due after 15 s


def test_a_wall_clock_step_makes_a_sample_due_at_once() -> None:
    host = Host()
    c = host.clock()
    c.now()
    assert not c.due()
    host.wall_off += 10.0  # NTP stepped the wall clock (or faketime moved it)
    assert c.due()
    assert c.now() == pytest.approx(host.true, abs=0.002)
    assert c.skew_s == pytest.approx(10.0, abs=0.002)
    assert host.reads == 2


def test_redis_unreachable_keeps_the_estimate_and_retries_later() -> None:
    host = Host(wall_off=HOUR)
    c = host.clock(refresh_s=1.0)
    c.now()
    host.fail = True
    host.true += 2.0
    assert c.now() == pytest.approx(host.true, abs=0.002)  # the sample in use, advanced
    assert (host.reads, c.failures) == (2, 1)
    host.true += RETRY_S / 2
    c.now()
    assert host.reads == 2  # no retry before RETRY_S
    host.fail = False
    host.true += RETRY_S
    c.now()
    assert (host.reads, c.samples) == (3, 2)


def test_a_much_slower_round_trip_is_not_adopted_while_the_sample_in_use_is_young() -> None:
    host = Host(rtt=0.002)
    c = host.clock(refresh_s=1.0)
    c.now()
    host.true += 1.0
    host.rtt = 0.8  # a stalled thread: the midpoint could be 0.4 s off
    assert not c.refresh()
    assert c.rtt_s == pytest.approx(0.002, abs=1e-6)
    host.true += 5.0  # the one in use is now old: better a coarse sample than none
    assert c.refresh()
    assert c.rtt_s == pytest.approx(0.8, abs=1e-6)
    assert c.peek() == pytest.approx(host.true, abs=0.4)


def test_observe_adopts_a_reply_read_elsewhere() -> None:
    host = Host(wall_off=-HOUR)
    c = RedisClock(None, wall=host.wall, mono=host.mono)
    assert not c.due() or c.now() == host.wall()  # no reader: never reads itself
    sent = host.mono()
    reply = host.time_reply()
    assert c.observe(reply, sent, host.mono())
    assert c.peek() == pytest.approx(host.true, abs=0.002)
    assert c.skew_s == pytest.approx(-HOUR, abs=0.002)


def test_the_process_clock_is_the_installed_one() -> None:
    host = Host(wall_off=HOUR)
    c = host.clock()
    c.now()
    try:
        shared_clock.install(c)
        assert shared_clock.now_s() == pytest.approx(host.true, abs=0.002)
    finally:
        shared_clock.install(None)
    assert shared_clock.current() is None


class Gauge:
    def __init__(self) -> None:
        self.value: float | None = None

    def set(self, value: float) -> None:
        self.value = value


def test_skew_past_the_bound_is_warned_once_and_always_exported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    host = Host(wall_off=HOUR)
    gauge = Gauge()
    c = host.clock(refresh_s=1.0)
    c.on_sample(clock_watch.SkewReport(1.0, gauge))
    with caplog.at_level(logging.INFO, logger="fleet.clock"):
        c.now()
        host.true += 2.0
        c.now()  # a second sample, same skew: no second warning
        warned = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and "+3600.000 s off Redis'" in warned[0].getMessage()
        assert gauge.value == pytest.approx(HOUR, abs=0.002)
        host.wall_off = 0.2  # synced again
        c.now()
        assert "back within 1.000 s" in caplog.records[-1].getMessage()
    assert gauge.value == pytest.approx(0.2, abs=0.002)


def test_start_puts_kombus_scores_and_restore_ceiling_on_redis_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kombu's Redis transport scores deliveries and computes its restore scan's ceiling
    from its module-level ``time``: after ``start`` it is Redis' clock, so a worker an hour
    ahead does not take every lease for lapsed (nor one behind its own for fresh)."""
    monkeypatch.setattr(kombu_redis, "time", kombu_redis.time)  # restored after the test
    host = Host(wall_off=HOUR)
    c = host.clock()
    try:
        clock_watch.start(c, 1.0, Gauge())
        assert shared_clock.current() is c
        assert kombu_redis.time() == pytest.approx(host.true, abs=0.002)
        captured: dict[str, Any] = {}

        class Lock:
            def acquire(self, blocking: bool = True) -> bool:
                return True

            def release(self) -> None:
                pass

        class Client:  # what kombu's restore scan asks of Redis
            def lock(self, name: str, timeout: float) -> Lock:
                return Lock()

            def zrange(self, key: str, ceil: float, *_a: Any, **_k: Any) -> list[Any]:
                captured["ceil"] = ceil
                return []

        @contextlib.contextmanager
        def conn_or_acquire(client: Any = None) -> Iterator[Client]:
            yield Client()

        channel = SimpleNamespace(
            visibility_timeout=8.0,
            unacked_index_key="unacked_index",
            unacked_mutex_key="unacked_mutex",
            unacked_mutex_expire=10,
            conn_or_acquire=conn_or_acquire,
        )
        qos = kombu_redis.QoS.__new__(kombu_redis.QoS)
        qos._vrestore_count = 0
        qos.channel = channel
        qos.restore_visible(num=10, interval=1)
        assert captured["ceil"] == pytest.approx(host.true - 8.0, abs=0.01)
    finally:
        shared_clock.install(None)

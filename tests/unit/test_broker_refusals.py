"""``workers.batching.refusals``: which Redis errors are refused writes (the texts are what Redis
6.2 and redis-py answer, as the integration test meets them), and the state a worker keeps
of them (a refusal per part, stale parts forgotten, restore scans held back)."""

from __future__ import annotations

import pytest
from redis.exceptions import (
    ConnectionError,
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
)

from workers.batching.refusals import STALE_S, Refusals, backoff_s, reason_of

SCRIPT = "Error running script (call to f_02ca): @user_script:1: @user_script: 1: "


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (ResponseError("MISCONF Errors writing to the AOF file: No space left on device"),
         "MISCONF"),
        (ResponseError(SCRIPT + "-MISCONF Errors writing to the AOF file: No space left"),
         "MISCONF"),
        (ResponseError("Command # 1 (ZADD z 2 a) of pipeline caused error: MISCONF Errors"),
         "MISCONF"),
        (OutOfMemoryError("command not allowed when used memory > 'maxmemory'."), "OOM"),
        (ResponseError(SCRIPT + "-OOM command not allowed when used memory > 'maxmemory'."),
         "OOM"),
        (ReadOnlyError("You can't write against a read only replica."), "READONLY"),
        (ResponseError(SCRIPT + "-READONLY You can't write against a read only replica."),
         "READONLY"),
        (NoPermissionError("this user has no permissions to run the 'zadd' command"), "NOPERM"),
        (ResponseError(SCRIPT + "The user executing the script can't run this command or "
                       "subcommand"), "NOPERM"),
        (ResponseError("NOPERM this user has no permissions to run the 'evalsha' command"),
         "NOPERM"),
        (ResponseError("ERR unknown command 'FOO'"), None),
        (ResponseError("UNBLOCKED force unblock from blocking operation"), None),
        (ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
         None),
        (ResponseError(SCRIPT + "user_script:1: Script attempted to access a ZOOM key"), None),
        (ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused."), None),
    ],
)  # fmt: skip
def test_refused_writes_are_told_from_other_errors(exc: Exception, reason: str | None) -> None:
    assert reason_of(exc) == reason


def test_backoff_grows_to_a_second() -> None:
    assert [backoff_s(n) for n in (1, 2, 3, 4, 9)] == [0.25, 0.5, 1.0, 1.0, 1.0]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_refusal_lasts_until_every_part_that_saw_it_writes_again() -> None:
    clock = Clock()
    r = Refusals(clock)
    r.configure(hold_s=12.0, first_scan_s=4.0)
    assert not r.refusing() and not r.scans_allowed()  # a fresh worker lets holders renew
    clock.now += 4.0
    assert r.scans_allowed()
    assert r.refused("lease", "MISCONF", "MISCONF Errors writing") == 0.25
    assert r.refused("lease", "MISCONF") == 0.5  # the part's next try waits longer
    r.refused("fetch", "MISCONF")
    assert r.reasons() == {"MISCONF"} and r.refusing("fetch")
    assert not r.scans_allowed()
    r.accepted("lease")
    assert r.refusing()  # the fetch has not written yet
    clock.now += 1.0
    r.accepted("fetch")
    assert not r.refusing() and r.episodes == 1
    assert not r.scans_allowed()  # holders renew first: hold_s from the last refusal
    clock.now += 10.9
    assert not r.scans_allowed()
    clock.now += 0.1
    assert r.scans_allowed()


def test_a_part_that_stops_trying_stops_counting() -> None:
    clock = Clock()
    r = Refusals(clock)
    r.refused("results", "NOPERM")
    clock.now += STALE_S + 0.1
    assert r.reasons() == set()
    assert r.refused("results", "NOPERM") == 0.25  # a new refusal, its tries from 1
    assert r.episodes == 2


def test_accepting_writes_costs_nothing_without_a_refusal() -> None:
    r = Refusals(Clock())
    r.accepted("fetch")
    assert r.snapshot() == {
        "refusing": [],
        "refusals": 0,
        "episodes": 0,
        "scans_allowed": True,
    }

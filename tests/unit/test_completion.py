"""``workers.batching.completion``: the hand-off to the loop thread and settling there, without
Redis.

A fake result writer (first-wins in a dict, refusing on demand), a fake host (acks and
Celery's bookkeeping recorded) and fake requests that record their events; the hand-off,
the completer and the loop are the real ones. The event loop is a recording stand-in for
kombu's hub: what it would run later, the test runs by hand.
"""

from __future__ import annotations

import ast
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine_fakes import MODALITY, Doubler, FakeReq, work

from shared.errors import InvalidInput, ModelError
from shared.metrics import FleetMetrics
from shared.settings import Settings
from shared.tracing import Tracing
from workers.batching.batcher import Work
from workers.batching.completion import (
    SETTLE_GIVE_UP_S,
    Acks,
    Completer,
    Done,
    EngineStats,
    Handoff,
    Loop,
    Observers,
    Outcome,
    Progress,
    ProgressThrottle,
    Started,
)


@dataclass
class EventReq(FakeReq):
    events: list[str] = field(default_factory=list)  # shared: one timeline for the test

    def send_event(self, name: str, **_: Any) -> None:
        self.events.append(f"{name}:{self.id}")

    def on_accepted(self, pid: int, time_accepted: float) -> None:
        self.events.append(f"accepted:{self.id}")


class Writer:
    """First-wins results in a dict, each under its write token (the rule of
    ``workers.batching.completion``: a write finding its own token's result reports it
    stored); refuses ``refuse`` writes first (Redis restarting); ``lose_replies`` writes are
    done, then raise (the reply lost)."""

    def __init__(self, timeline: list[str]) -> None:
        self.stored: dict[str, Outcome] = {}
        self.tokens: dict[str, str] = {}
        self.refuse = 0
        self.lose_replies = 0
        self.timeline = timeline

    def write(
        self,
        outcomes: Sequence[Outcome],
        tokens: Sequence[str] | None = None,
        acks: Acks | None = None,
    ) -> list[bool]:
        if self.refuse:
            self.refuse -= 1
            raise ConnectionError("Redis is loading the dataset in memory")
        firsts = []
        for o, t in zip(outcomes, tokens or [""] * len(outcomes), strict=True):
            mine = self.tokens.get(o.task_id)
            firsts.append(mine is None or (bool(t) and mine == t))
            self.stored.setdefault(o.task_id, o)
            self.tokens.setdefault(o.task_id, t)
            self.timeline.append(f"stored:{o.task_id}")
        if acks is not None:  # after every write, in the same call
            self.timeline.extend(f"acked:{t}" for t in acks.tags)
        if self.lose_replies:
            self.lose_replies -= 1
            raise ConnectionError("Connection closed by server.")
        return firsts

    def write_progress(self, task_id: str, progress: dict[str, int]) -> None:
        self.timeline.append(f"progress:{task_id}:{progress['done']}/{progress['total']}")


@dataclass
class Plan:
    """Acks that travel with a result write (``workers.consumer.lease.AckPlan``): the ids
    stand for delivery tags."""

    tags: list[str]
    also: Sequence[tuple[Any, ...]] = ()
    finished: int = 0

    def finish(self, release: bool = True) -> int:
        self.finished += 1
        return len(self.tags)


class Host:
    def __init__(self, timeline: list[str]) -> None:
        self.timeline = timeline
        self.given_back: list[str] = []
        self.plans: list[Plan] = []

    def ack(self, reqs: list[Any]) -> int:
        self.timeline.extend(f"acked:{r.id}" for r in reqs)
        return len(reqs)

    def plan_acks(self, reqs: list[Any]) -> Acks:
        self.plans.append(Plan([r.id for r in reqs]))
        return self.plans[-1]

    def task_ready(self, reqs: Sequence[Any]) -> None:
        pass

    def accepted(self, reqs: list[Any]) -> None:
        for req in reqs:
            req.on_accepted(0, 0.0)

    def send_events(self, type_: str, items: Any) -> None:
        for req, fields in items:
            req.send_event(type_, **fields)

    def forget(self, done: Sequence[Done]) -> None:
        pass

    def give_back_unsettled(self, done: list[Done]) -> None:
        self.given_back += [d.req.id for d in done]


class Hub:
    """Records what kombu's hub would call later."""

    def __init__(self) -> None:
        self.later: list[tuple[float, Callable[..., None], tuple[Any, ...]]] = []

    def add_reader(self, fd: int, cb: Callable[[], None]) -> None:
        pass

    def call_later(self, delay: float, fn: Callable[..., None], *args: Any) -> None:
        self.later.append((delay, fn, args))


@dataclass
class Bench:
    timeline: list[str]
    writer: Writer
    host: Host
    hub: Hub
    stats: EngineStats
    handoff: Handoff
    adapter: Doubler

    def work(self, rid: str) -> Work:
        w = work(rid, 1, self.adapter)
        w.req = EventReq(rid, events=self.timeline)
        return w


def bench(store_early: bool = False) -> Bench:
    timeline: list[str] = []
    writer, host, hub, stats, loop = Writer(timeline), Host(timeline), Hub(), EngineStats(), Loop()
    obs = Observers(stats, FleetMetrics(MODALITY), Tracing(Settings(), MODALITY))
    completer = Completer(writer, host, loop, obs, ProgressThrottle())  # type: ignore[arg-type]
    handoff = Handoff(completer, loop, lambda: store_early)
    handoff.attach(hub)
    return Bench(timeline, writer, host, hub, stats, handoff, Doubler())


def ok(w: Work) -> Done:
    return Done(w, w.req, Outcome(w.req.id, result={"y": 2}))


def test_posted_items_wait_for_the_loop_and_settle_in_order_result_before_ack() -> None:
    b = bench()
    a, c = b.work("a"), b.work("c")
    b.handoff.post([Started([a, c])])
    b.handoff.post([ok(a), Progress(c, 1, 2)])
    b.handoff.post([ok(c)])
    assert b.timeline == []  # nothing happens on the posting thread
    b.handoff.drain()
    assert b.timeline == [
        "accepted:a",
        "accepted:c",
        "stored:a",
        "acked:a",
        "task-succeeded:a",
        "progress:c:1/2",
        "task-progress:c",
        "stored:c",
        "acked:c",
        "task-succeeded:c",
    ]
    assert b.stats.succeeded == 2


def test_the_realtime_lane_stores_at_once_and_acks_on_the_loop() -> None:
    b = bench(store_early=True)
    a = b.work("a")
    b.handoff.post([ok(a)])
    assert b.timeline == ["stored:a"]
    b.handoff.drain()
    assert b.timeline == ["stored:a", "acked:a", "task-succeeded:a"]


def test_a_refused_result_write_is_retried_with_backoff_and_acked_only_after_it() -> None:
    b = bench()
    b.writer.refuse = 1
    a = b.work("a")
    b.handoff.post([Done(a, a.req, Outcome("a", error=ModelError("boom")))])
    b.handoff.drain()
    assert b.timeline == [] and b.stats.settle_retries == 1
    [(delay, fn, args)] = b.hub.later
    assert delay == 0.1
    fn(*args)  # the loop runs the retry
    assert b.timeline == ["stored:a", "acked:a", "task-failed:a"]
    assert b.stats.errors == {"MODEL_ERROR": 1}


@dataclass
class FieldsReq(EventReq):
    fields: dict[str, dict[str, Any]] = field(default_factory=dict)

    def send_event(self, name: str, **fields: Any) -> None:
        super().send_event(name)
        self.fields[name] = fields


def test_settled_events_carry_a_summary_as_their_result_never_the_result() -> None:
    """Flower's result column (producer/ops/flower_app.py): a success's batch and timings;
    a failure's error code first, with its batch when it ran in one."""
    b = bench()
    ran, failed, refused = b.work("ran"), b.work("failed"), b.work("refused")
    for w in (ran, failed, refused):
        w.req = FieldsReq(w.req.id, events=b.timeline)
    for w in (ran, failed):
        w.started_s, w.batch_id, w.batch_size = 0.25, "b1", 2
    b.handoff.post(
        [
            Done(ran, ran.req, Outcome("ran", result={"y": 2}), run_ms=12.5),
            Done(failed, failed.req, Outcome("failed", error=ModelError("boom")), run_ms=3.0),
            Done(refused, refused.req, Outcome("refused", error=InvalidInput("empty"))),
        ]
    )
    b.handoff.drain()
    ok_fields = ran.req.fields["task-succeeded"]
    assert ast.literal_eval(ok_fields["result"]) == {
        "batch_id": "b1",
        "batch_size": 2,
        "queued_ms": 250.0,
        "run_ms": 12.5,
    }
    failure = failed.req.fields["task-failed"]
    summary = ast.literal_eval(failure["result"])
    assert next(iter(summary)) == "error" and summary["error"] == "MODEL_ERROR"
    assert summary["batch_size"] == 2 and summary["run_ms"] == 3.0
    assert "boom" in failure["exception"]  # the exception field is as before
    assert ast.literal_eval(refused.req.fields["task-failed"]["result"]) == {
        "error": "INVALID_INPUT"
    }


def test_a_write_whose_reply_was_lost_is_retried_and_counted_once_not_as_a_duplicate() -> None:
    """Redis ran the write and went away before replying: the retry (same token) finds
    the request's own result. It is this request's one success (its event, its log line,
    its metrics), not a duplicate acked in silence. The acks went in the lost call too (Redis
    removed the entries after the write); their bookkeeping waits for the retry, which
    acks again (a no-op in Redis) and finishes the request once."""
    b = bench()
    b.writer.lose_replies = 1
    a = b.work("a")
    b.handoff.post([ok(a)])
    b.handoff.drain()
    assert b.timeline == ["stored:a", "acked:a"] and b.stats.settle_retries == 1
    assert [p.finished for p in b.host.plans] == [0]  # no bookkeeping without a reply
    [(_, fn, args)] = b.hub.later
    fn(*args)
    assert b.timeline == ["stored:a", "acked:a", "stored:a", "acked:a", "task-succeeded:a"]
    assert [p.finished for p in b.host.plans] == [0, 1]
    assert b.stats.duplicates == 0 and b.stats.succeeded == 1


def test_a_copy_whose_result_stands_already_is_acked_without_events() -> None:
    b = bench()
    b.writer.stored["a"] = Outcome("a", result={"y": 2})
    b.writer.tokens["a"] = "another-copy"
    a = b.work("a")
    b.handoff.post([ok(a)])
    b.handoff.drain()
    assert b.timeline == ["stored:a", "acked:a"]  # no second task-succeeded
    assert b.stats.duplicates == 1 and b.stats.succeeded == 0


def test_a_request_unsettled_for_the_give_up_time_is_given_back_unacked() -> None:
    b = bench()
    b.writer.refuse = 1
    a = b.work("a")
    d = ok(a)
    d.first_failure_s = time.monotonic() - SETTLE_GIVE_UP_S
    b.handoff.post([d])
    b.handoff.drain()
    assert b.host.given_back == ["a"] and b.hub.later == []
    assert "acked:a" not in b.timeline


def test_wait_handled_returns_once_the_loop_stored_what_was_posted_before_it() -> None:
    """A suspect batch waits for this before it runs (``workers.batching.execution``): results
    posted, but not yet stored, would be blamed for a death the suspect causes."""
    b = bench()
    a, c = b.work("a"), b.work("c")
    assert b.handoff.wait_handled(0.0)  # nothing posted: nothing to wait for
    b.handoff.post([ok(a)])
    assert not b.handoff.wait_handled(0.05)  # posted, the loop has not drained
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(b.handoff.wait_handled(5.0)))
    waiter.start()
    time.sleep(0.05)
    assert got == []  # still waiting
    b.handoff.drain()  # the loop thread stores a's result
    waiter.join(timeout=5)
    assert got == [True] and "stored:a" in b.timeline
    b.handoff.post([ok(c)])
    b.writer.refuse = 1  # a refused write is handled too: its retry is scheduled
    b.handoff.drain()
    assert b.handoff.wait_handled(0.0) and "stored:c" not in b.timeline

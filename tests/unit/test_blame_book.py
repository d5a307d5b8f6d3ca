"""Blame records' bookkeeping (``workers.batching.admission``: ``BlameBook``, ``encode_id``,
``redelivered``) and poison accounting over them (``engine_fakes.MemoryCounters``). The Lua
scripts on a real Redis: tests/integration/test_blame_records.py."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
from engine_fakes import MemoryCounters

from workers.batching.admission import (
    FINAL,
    BlameBook,
    Deliveries,
    InFlight,
    encode_id,
    redelivered,
)


def test_an_id_is_recorded_without_spaces_and_never_as_a_piece_of_another() -> None:
    assert encode_id("a b%20") == "a%20b%2520"
    assert encode_id("plain-uuid") == "plain-uuid"
    assert " " not in BlameBook.value(["a b", "c"]).replace(" ", "", 1)
    assert f" {encode_id('a')} " not in f" {BlameBook.value(['a b'])} "


def test_a_record_is_indexed_on_its_first_write_and_when_it_may_have_expired() -> None:
    now = [0.0]
    book = BlameBook("h:1:ab", ttl_s=100, clock=lambda: now[0])
    assert book.key("decode") == "fleet:blame:h:1:ab:decode"
    assert book.prefix == "fleet:blame:h:1:ab:"
    assert book.put("decode", ["a"])  # first write
    now[0] = 40.0
    assert not book.put("decode", [])  # rewritten well within its TTL
    now[0] = 95.0
    assert book.put("decode", ["b"])  # half a TTL since the last write: index it again
    assert not book.put("decode", ["c"])
    book.unsure("decode")  # that write may have failed
    assert book.put("decode", ["c"])


def test_removing_ids_rewrites_only_the_records_that_name_them() -> None:
    book = BlameBook("h:1:ab", ttl_s=100)
    book.put("decode", ["a", "b"])
    book.put("lane-1", ["c", "d"])
    assert book.remove(["b", "x"]) == {"decode": ["a"]}
    assert book.remove(["a", "c"]) == {"decode": ["b"], "lane-1": ["d"]}  # not applied yet
    assert book.remove(["x"]) == {}


def test_each_lane_thread_has_a_slot_of_its_own() -> None:
    book = BlameBook("h:1:ab", ttl_s=100)
    slots: list[str] = []
    t = threading.Thread(target=lambda: slots.append(book.lane()))
    t.start()
    t.join()
    assert book.lane() == book.lane() and book.lane() not in slots
    assert sorted([book.lane(), *slots]) == ["lane-1", "lane-2"]


def test_redelivered_reads_kombus_mark_in_delivery_info_or_headers() -> None:
    assert redelivered(SimpleNamespace(delivery_info={"redelivered": True}))
    msg = SimpleNamespace(headers={"redelivered": True})
    assert redelivered(SimpleNamespace(delivery_info={}, message=msg))
    plain = SimpleNamespace(
        delivery_info={"redelivered": False}, message=SimpleNamespace(headers={})
    )
    assert not redelivered(plain)
    assert not redelivered(SimpleNamespace())


def test_a_dead_incarnations_record_counts_only_for_a_redelivered_message() -> None:
    c = MemoryCounters()
    d = Deliveries(c)
    d.arrive(["x", "y"], [False, False])
    d.decoded(["x", "y"])
    assert d.counters.begin(["x", "y"]) == [1, 1]
    c.die()
    assert d.arrive(["x", "y"], [True, False]) == [2, 1]  # y is not looked up


def test_own_records_and_waiting_in_the_window_blame_nobody() -> None:
    c = MemoryCounters()
    d = Deliveries(c)
    d.arrive(["x", "w"], [False, False])
    d.decoded(["x", "w"])  # w now merely waits in the window
    c.begin(["x"])
    assert d.arrive(["x"], [True]) == [1]  # its own incarnation's records: not a death
    c.die()  # decoding x (again) and running it: one death
    assert d.arrive(["x", "w"], [True, True]) == [2, 1]


def test_an_incarnation_counts_once_whichever_of_its_records_name_the_message() -> None:
    c = MemoryCounters()
    c.arrive(["x"], [False])  # its decode record was never emptied (Redis refused)
    c.begin(["x"])
    assert c.named("x") == 2
    c.die()
    assert c.arrive(["x"], [True]) == [2]


def test_a_release_takes_ids_out_of_every_record() -> None:
    c = MemoryCounters()
    c.arrive(["a", "b"], [False, False])
    c.begin(["a", "c"])
    c.uncount(["a", "b"])
    assert (c.named("a"), c.named("b"), c.named("c")) == (0, 0, 1)
    c.die()
    assert c.arrive(["a", "b", "c"]) == [1, 1, 2]


def test_a_worker_that_stopped_leaves_no_record() -> None:
    c = MemoryCounters()
    d = Deliveries(c)
    c.arrive(["a"], [False])
    c.begin(["a", "b"])
    d.retire()
    assert c.named("a") == c.named("b") == 0 and c.book.slots == {}
    c.die()
    assert c.arrive(["a", "b"]) == [1, 1]


class _Pipe:
    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        self.log = log

    def __enter__(self) -> _Pipe:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **kw: self.log.append((name, *a, *sorted(kw.items())))

    def execute(self) -> list[Any]:
        return []


class _Client:
    """What InFlight sends, without Redis; the gate's script answers ``answer``."""

    def __init__(self, answer: list[int]) -> None:
        self.answer = answer
        self.log: list[tuple[Any, ...]] = []

    def register_script(self, text: str) -> Any:
        return lambda keys, args: list(self.answer)

    def pipeline(self, transaction: bool = True) -> _Pipe:
        return _Pipe(self.log)


def test_a_final_answer_the_primary_does_not_confirm_runs_and_is_recorded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Behind Sentinel a FINAL answer is confirmed on the primary; one it does not confirm
    runs (writes are first-wins), and the lane's record is written again to name it."""
    import shared.redis_client

    monkeypatch.setattr(shared.redis_client, "execute_waiting", lambda c, p, w: [0])
    client = _Client([FINAL, 1])
    flight = InFlight(client, 60, waiter=object(), name="h:1:ab")  # type: ignore[arg-type]
    assert flight.begin(["done", "new"]) == [1, 1]
    key = flight.book.key("lane-1")
    assert ("set", key, "done new", ("ex", 60)) in client.log
    assert flight.book.slots["lane-1"] == ["done", "new"]
    client.answer = [FINAL, 1]
    monkeypatch.setattr(shared.redis_client, "execute_waiting", lambda c, p, w: [1])
    assert flight.begin(["done", "new"]) == [FINAL, 1]
    assert flight.book.slots["lane-1"] == ["new"]

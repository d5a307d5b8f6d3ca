"""``workers.batching.admission.Isolation``: a suspect batch runs alone, so a worker's death
while it runs is blamed on it only (real threads, no servers).

Before it, a suspect's batch could run while the next arrival group was still counted and
decoding; its crash then counted a death against every request of that group (in CI an
innocent request reached three and was refused ``WORKER_LOST``:
tests/integration/test_faults.py reproduces it against a real worker).
"""

from __future__ import annotations

import threading
import time

from engine_fakes import MODALITY, Doubler, FakeReq, MemoryCounters, envelope

from shared.settings import Settings
from shared.tracing import Tracing
from workers.batching.admission import Admission, Deliveries, Isolation
from workers.batching.inject import RequestInjector


def no_store() -> object:
    raise AssertionError("inputs without /dev/shm refs never open the store")


def in_thread(target: object) -> threading.Thread:
    t = threading.Thread(target=target, daemon=True)  # type: ignore[arg-type]
    t.start()
    return t


def suspect_inside(iso: Isolation) -> tuple[threading.Thread, threading.Event]:
    """A suspect batch running in a thread until the returned event is set."""
    inside, leave = threading.Event(), threading.Event()

    def suspect() -> None:
        with iso.running(suspect=True):
            inside.set()
            leave.wait(5.0)

    t = in_thread(suspect)
    assert inside.wait(2.0)
    return t, leave


def test_a_suspect_waits_for_a_decoding_arrival_group_then_runs() -> None:
    iso = Isolation()
    assert iso.try_admit()
    ran = threading.Event()

    def suspect() -> None:
        with iso.running(suspect=True):
            ran.set()

    t = in_thread(suspect)
    assert not ran.wait(0.2)  # the group is still counted: the suspect must not run
    iso.admitted()
    assert ran.wait(2.0)
    t.join(2.0)
    assert iso.snapshot() == {"batches": 0, "admitting": 0, "suspects": 0}


def test_arrivals_are_deferred_while_a_suspect_runs_and_resumed_when_it_ends() -> None:
    cleared = threading.Event()
    iso = Isolation(on_clear=cleared.set)
    t, leave = suspect_inside(iso)
    assert iso.try_admit() is False  # the event loop is never blocked: it defers
    assert not cleared.is_set()
    leave.set()
    t.join(2.0)
    assert cleared.is_set()  # the engine admits what waited then
    assert iso.try_admit() is True
    iso.admitted()


def test_a_suspect_waits_for_running_batches_and_blocks_new_ones() -> None:
    iso = Isolation()
    order: list[str] = []
    in_batch, end_batch = threading.Event(), threading.Event()

    def batch(name: str, hold: threading.Event | None = None) -> None:
        with iso.running(suspect=False):
            order.append(f"{name} start")
            if hold is not None:
                in_batch.set()
                hold.wait(5.0)
            order.append(f"{name} end")

    def suspect() -> None:
        with iso.running(suspect=True):
            order.append("suspect start")
            time.sleep(0.2)
            order.append("suspect end")

    first = in_thread(lambda: batch("a", end_batch))
    assert in_batch.wait(2.0)
    s = in_thread(suspect)
    time.sleep(0.1)
    later = in_thread(lambda: batch("b"))  # arrives while the suspect waits: goes after it
    time.sleep(0.1)
    assert order == ["a start"]
    end_batch.set()
    for t in (first, s, later):
        t.join(3.0)
    assert order == ["a start", "a end", "suspect start", "suspect end", "b start", "b end"]


def test_two_suspects_never_run_together() -> None:
    iso = Isolation()
    running, most = [0], [0]
    lock = threading.Lock()

    def suspect() -> None:
        with iso.running(suspect=True):
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            time.sleep(0.05)
            with lock:
                running[0] -= 1

    threads = [in_thread(suspect) for _ in range(4)]
    for t in threads:
        t.join(3.0)
    assert most[0] == 1


def test_a_blocking_admission_waits_for_the_suspect() -> None:
    iso = Isolation()
    t, leave = suspect_inside(iso)
    threading.Timer(0.2, leave.set).start()
    t0 = time.monotonic()
    assert iso.try_admit(block=True)  # a shutdown's last admission: it may wait
    assert time.monotonic() - t0 >= 0.15
    iso.admitted()
    t.join(2.0)


def test_admission_marks_a_delivery_with_an_earlier_death_suspect() -> None:
    counters = MemoryCounters()
    adm = Admission(
        Doubler(),
        Deliveries(counters),
        RequestInjector(False),
        Tracing(Settings(), MODALITY),
        no_store,
    )
    [count] = adm.deliveries.arrive(["x"])
    first = adm.admit(FakeReq("x"), envelope(1), count)
    assert not isinstance(first, Exception) and first.item.suspect is False
    adm.deliveries.decoded(["x"])
    adm.deliveries.begin([first.item])  # ran; its worker then died (its records stay)
    counters.die()
    [count] = adm.deliveries.arrive(["x"])
    again = adm.admit(FakeReq("x"), envelope(1), count)
    assert not isinstance(again, Exception) and again.item.suspect is True

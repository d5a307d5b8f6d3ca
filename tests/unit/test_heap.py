"""workers.batching.heap: the startup heap frozen out of the collector, and collection pauses
timed."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from workers.batching.heap import GcPauses, freeze_startup_heap


@pytest.fixture()
def unfrozen_after() -> Iterator[None]:
    yield
    gc.unfreeze()


def test_freezing_moves_what_is_alive_out_of_every_generation(unfrozen_after: None) -> None:
    keep = [[i] for i in range(50_000)]  # objects the collector tracks
    frozen = freeze_startup_heap()
    assert frozen == gc.get_freeze_count() >= len(keep)
    assert sum(gc.get_count()) < 1_000  # nothing left waiting in the generations
    tracked = {id(o) for o in gc.get_objects()}
    assert id(keep[0]) not in tracked and id(keep[-1]) not in tracked


def test_pauses_are_counted_per_generation_and_timed() -> None:
    pauses = GcPauses()
    pauses.install()
    pauses.install()  # idempotent: one callback
    try:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    finally:
        pauses.uninstall()
    gc.collect(2)  # after uninstall: not counted
    snap = pauses.snapshot()
    gens = snap["generations"]
    assert gens[2]["count"] == 2 and gens[0]["count"] >= 1
    assert 0 < gens[2]["max_s"] <= gens[2]["total_s"]
    assert snap["frozen"] == gc.get_freeze_count()


def test_reset_forgets_what_was_counted() -> None:
    pauses = GcPauses()
    pauses.install()
    try:
        gc.collect(2)
        pauses.reset()
        gc.collect(1)
    finally:
        pauses.uninstall()
    gens = pauses.snapshot()["generations"]
    assert gens[2] == {"count": 0, "total_s": 0.0, "max_s": 0.0}
    assert gens[1]["count"] == 1

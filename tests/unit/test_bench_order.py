"""Pure logic of the bench's run order (``producer.tools.bench.order``): no servers."""

from __future__ import annotations

from collections import Counter

import pytest

from producer.tools.bench.order import rotation, run_interleaved
from producer.tools.bench.results import BenchResult, ModeResult


def test_rotation_moves_one_mode_to_the_back_per_repetition() -> None:
    runs = ["fleet", "baseline", "limit"]
    assert [rotation(runs, k) for k in range(4)] == [
        ["fleet", "baseline", "limit"],
        ["baseline", "limit", "fleet"],
        ["limit", "fleet", "baseline"],
        ["fleet", "baseline", "limit"],
    ]
    with pytest.raises(ValueError):
        rotation([], 0)


def _one(mode: str, rep: int) -> ModeResult:
    out = ModeResult(mode)
    out.reps.append([])
    out.summaries.append({"rep": rep})
    out.batches["text"] = Counter({32: rep + 1})
    out.cold["text"] = {"ready_s": float(rep)}
    return out


def test_every_mode_runs_once_per_repetition_and_merges_into_its_first_start() -> None:
    res = BenchResult(workload=None, repetitions=3, started_utc="")  # type: ignore[arg-type]
    calls: list[tuple[str, int, bool]] = []

    def service(mode: str, rep: int, first: bool) -> ModeResult:
        calls.append((mode, rep, first))
        return _one(mode, rep)

    def limit(rep: int) -> None:
        calls.append(("limit", rep, False))

    run_interleaved(["fleet", "baseline", "limit"], 3, res, service, limit)

    assert res.order == [rotation(["fleet", "baseline", "limit"], k) for k in range(3)]
    assert calls == [
        ("fleet", 0, True), ("baseline", 0, True), ("limit", 0, False),
        ("baseline", 1, False), ("limit", 1, False), ("fleet", 1, False),
        ("limit", 2, False), ("fleet", 2, False), ("baseline", 2, False),
    ]  # fmt: skip
    for mode in ("fleet", "baseline"):
        mr = res.modes[mode]
        assert [s["rep"] for s in mr.summaries] == [0, 1, 2]  # in repetition order
        assert mr.batches["text"] == Counter({32: 1 + 2 + 3})  # counts add up
        assert mr.cold["text"] == {"ready_s": 0.0}  # the first start's cold figures stay


def test_a_wall_clock_step_is_seen_and_resync_takes_it_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """A VM paused and resumed steps the wall clock: the repetition in which it happened is
    reported, and the next repetition's offset (resync) no longer carries it."""
    import time as real_time

    from producer.tools.bench import records

    tb = records.Timebase()
    assert tb.step_note("fleet repetition 1") is None
    wall = real_time.time
    monkeypatch.setattr(records.time, "time", lambda: wall() + 17.0)  # 17 s forward
    note = tb.step_note("fleet repetition 1")
    assert note is not None and "+17000 ms" in note and note.startswith("fleet repetition 1")
    assert tb.resync() == pytest.approx(17_000.0, abs=20.0)
    assert tb.step_note("fleet repetition 2") is None

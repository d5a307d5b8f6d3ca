"""The tenant-fairness bench's reading of the worker log (``producer/tools/bench/fairness.py``):
window arrival and batch start per request, and how many batches of the other tenant alone
started while a request was in the window."""

from __future__ import annotations

from datetime import datetime

import pytest

from producer.tools.bench.fairness import batches_behind, window_times

LOG = """[2026-01-02 03:04:05,000: INFO/MainProcess] request id=a1 state=SUCCESS code=- \
priority=bulk tenant=a queued_ms=100.0 run_ms=50.0 batch=h-1-1 size=1 bucket=8 length=3 \
attempts=1 total_ms=150.0 since_submit_ms=160.0
[2026-01-02 03:04:05,100: INFO/MainProcess] request id=a2 state=SUCCESS code=- \
priority=bulk tenant=a queued_ms=150.0 run_ms=50.0 batch=h-1-2 size=1 bucket=8 length=3 \
attempts=1 total_ms=200.0 since_submit_ms=210.0
request id=x state=SUCCESS code=- priority=bulk tenant=- queued_ms=1.0 run_ms=1.0 batch=- \
size=0 bucket=- length=0 attempts=1 total_ms=1.0 since_submit_ms=1.0
[2026-01-02 03:04:05,200: INFO/MainProcess] request id=b1 state=SUCCESS code=- \
priority=bulk tenant=b queued_ms=200.0 run_ms=50.0 batch=h-1-3 size=1 bucket=8 length=3 \
attempts=1 total_ms=250.0 since_submit_ms=260.0
"""


def stamp(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def test_window_times_come_from_the_record_time_and_the_line() -> None:
    times = window_times(LOG.replace("\\\n", ""), {"a1", "a2", "b1", "x"})
    assert set(times) == {"a1", "a2", "b1"}  # a request that never ran in a batch: none
    arrival, start, batch = times["b1"]
    assert batch == "h-1-3"
    assert arrival == pytest.approx(stamp("2026-01-02 03:04:05,200") - 0.25)
    assert start == pytest.approx(arrival + 0.2)


def test_batches_of_the_other_tenant_alone_while_waiting() -> None:
    times = window_times(LOG.replace("\\\n", ""), {"a1", "a2", "b1"})
    tenant_of = {"a1": "a", "a2": "a", "b1": "b"}
    # b1 entered the window at 04.950 and its batch started at 05.150; a1's batch started at
    # 04.950 (not after b1 arrived), a2's at 05.050: one batch of a's alone
    assert batches_behind(times, tenant_of, "b", "a") == (1, 1)

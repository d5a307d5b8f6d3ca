"""The gateway's pure logic: priority and timeout parameters, Prefer, ids, admission, auth,
error statuses."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from producer.gateway.admission import (
    RateMeter,
    SentJobs,
    ahead_of,
    deadline_refusal,
    queue_full,
)
from producer.gateway.auth import check_bearer
from producer.gateway.errors import STATUS_BY_CODE, Unauthorized, status_for
from producer.gateway.params import (
    Prefer,
    check_request_id,
    parse_prefer,
    priority_class,
    timeout_seconds,
    wait_budget,
)
from shared.errors import ERROR_CLASSES, InvalidInput, InvalidPriority
from shared.settings import ModalityConfig

GATEWAY_DOC = Path(__file__).resolve().parents[2] / "docs" / "gateway.md"


@pytest.mark.parametrize(
    ("value", "cls"),
    [(None, "normal"), (0, "normal"), (1, "realtime"), (2, "high"), (3, "normal"), (4, "bulk"),
     (99, "bulk"), (2.0, "high"), ("REALTIME", "realtime"), ("bulk", "bulk")],
)  # fmt: skip
def test_priority_levels_map_to_classes(value: object, cls: str) -> None:
    assert priority_class(value) == cls


@pytest.mark.parametrize("value", [-1, True, 1.5, "urgent", [1], {}])
def test_bad_priorities_are_refused_with_invalid_priority(value: object) -> None:
    with pytest.raises(InvalidPriority):
        priority_class(value)


def test_timeout_is_microseconds() -> None:
    assert timeout_seconds(250_000) == 0.25
    assert timeout_seconds(None) is None and timeout_seconds(0) is None
    for bad in (-1, True, "5", float("inf"), float("nan")):
        with pytest.raises(InvalidInput):
            timeout_seconds(bad)


def test_prefer_header_parsing_and_wait_budget() -> None:
    assert parse_prefer(["respond-async, wait=5"]) == Prefer(True, 5.0)
    assert parse_prefer(["wait=abc", "handling=lenient"]) == Prefer(False, None)
    assert parse_prefer(["Respond-Async; foo=bar"]).respond_async
    # wait=N wins, else the request's own time to its deadline, else the default; capped
    assert wait_budget(Prefer(False, 2.0), 0.2, 30, 300) == 2.0
    assert wait_budget(Prefer(), 0.2, 30, 300) == 0.2
    assert wait_budget(Prefer(), None, 30, 300) == 30
    assert wait_budget(Prefer(False, 9999), None, 30, 300) == 300


def test_request_ids() -> None:
    assert check_request_id("job-1.a:b_c") == "job-1.a:b_c"
    for bad in ("", "-lead", "a" * 129, "sp ace", "slash/x", 5, None, "ü"):
        with pytest.raises(InvalidInput):
            check_request_id(bad)


def test_rate_meter_needs_a_backlog_enough_completions_and_a_span() -> None:
    m = RateMeter(window_s=10.0, min_samples=10)
    assert m.rate(0.0) is None
    m.observe_depth(0.0, 0)  # empty at the start: nothing counted before this
    for i in range(20):  # 20 completions over 1.9 s, queue backlogged throughout
        m.observe_depth(i * 0.1, 50)
        m.observe_completion(i * 0.1)
    assert m.rate(2.0) == pytest.approx(19 / 1.9)
    m.observe_depth(2.0, 0)  # the queue ran dry: completions followed arrivals
    assert m.rate(2.0) is None
    m.observe_depth(2.1, 50)  # backlogged again, but its completions start over
    assert m.rate(2.1) is None
    for i in range(20):
        m.observe_completion(3.0 + i * 0.1)
    assert m.rate(5.0) == pytest.approx(19 / 1.9)
    assert m.rate(16.0) is None  # everything aged out of the window
    short = RateMeter(window_s=10.0, min_samples=5)
    short.observe_depth(0.0, 5)
    for i in range(10):
        short.observe_completion(i * 0.05)
    assert short.rate(0.5) is None  # 10 completions within 0.45 s: too short a span


def test_deadline_refusal_only_when_even_a_faster_rate_misses() -> None:
    # 300 ahead at 100/s: 3 s expected; with safety 2 at least 1.5 s
    assert deadline_refusal(300, 100.0, 1.0, 2.0) is not None
    refusal = deadline_refusal(300, 100.0, 1.0, 2.0)
    assert refusal is not None and refusal.retry_after_s == 3
    assert deadline_refusal(300, 100.0, 2.0, 2.0) is None  # 1.5 s <= 2 s: could make it
    assert deadline_refusal(300, None, 0.001, 2.0) is None  # no rate known: admit
    assert deadline_refusal(300, 100.0, None, 2.0) is None  # no deadline: admit
    assert deadline_refusal(0, 100.0, 0.0, 2.0) is None  # nothing ahead


def test_ahead_counts_only_classes_served_before() -> None:
    depth = {"realtime": 7, "high": 1, "normal": 10, "bulk": 100}
    assert ahead_of("realtime", depth) == 7  # its own queue
    assert ahead_of("high", depth) == 1
    assert ahead_of("normal", depth) == 11
    assert ahead_of("bulk", depth) == 111


def test_queue_full_as_the_client_decides_it() -> None:
    cfg = ModalityConfig(model="m", max_queue_length=10, max_queue_length_by_priority={"high": 2})
    assert queue_full(cfg, {"high": 0, "normal": 9}, "text", "normal") is None
    assert "limit is 10" in str(queue_full(cfg, {"high": 0, "normal": 10}, "text", "bulk"))
    assert "text/high" in str(queue_full(cfg, {"high": 2}, "text", "high"))
    assert queue_full(None, {"normal": 10**9}, "text", "normal") is None


def test_bearer_token() -> None:
    check_bearer("Bearer s3cret", "s3cret")
    check_bearer("bearer s3cret ", "s3cret")
    for bad in (None, "", "Basic s3cret", "Bearer", "Bearer nope"):
        with pytest.raises(Unauthorized):
            check_bearer(bad, "s3cret")


def test_every_fleet_code_has_one_documented_status() -> None:
    for code, cls in ERROR_CLASSES.items():
        assert code in STATUS_BY_CODE, code
        if issubclass(cls, InvalidInput):  # bad input is never a 5xx
            assert 400 <= status_for(code) < 500, code
    assert status_for("SOMETHING_NEW") == 500
    page = GATEWAY_DOC.read_text()  # its "Status codes" table, up to the next heading
    section = page[page.index("## Status codes") :]
    documented = set(re.findall(r"`([A-Z_]+)`", section[: section.index("\n#")]))
    assert set(STATUS_BY_CODE) <= documented, set(STATUS_BY_CODE) - documented


def test_sent_jobs_are_observed_once_and_bounded() -> None:
    """A completion counts once per job sent here; jobs never waited on (respond-async) do
    not grow the map without bound: past the limit the oldest is forgotten."""
    sent = SentJobs(limit=3)
    for i in range(5):
        sent.sent(f"j{i}", "text.normal")
    assert len(sent) == 3
    assert sent.observed("j0") is None and sent.observed("j1") is None  # forgotten
    assert sent.observed("j4") == "text.normal"
    assert sent.observed("j4") is None  # once
    assert sent.observed("never-sent") is None

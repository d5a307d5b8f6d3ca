"""workers.results.ResultWriter against a real Redis of its own (so the server's command
counts are this test's alone): a batch's results in one round trip, the first one winning,
and still stored after the server lost its scripts."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis

from shared import jsonfast
from shared.celery_app import make_app
from shared.errors import DeadlineExceeded
from tests.conftest import own_redis as own_redis_stack
from workers.results import Outcome, ResultWriter

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with own_redis_stack(tmp_path_factory, "results-run") as st:
        yield st


def _calls(admin: redis.Redis) -> dict[str, int]:
    stats = admin.info("commandstats")
    return {k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items()}


def _stored(admin: redis.Redis, app: Any, task_id: str) -> dict[str, Any]:
    raw = admin.get(app.backend.get_key_for_task(task_id))
    assert raw is not None, f"no result stored for {task_id}"
    return jsonfast.loads(raw)


def test_a_batch_is_written_with_evalsha_alone_and_the_first_result_wins(own_redis: Any) -> None:
    """No ``SCRIPT EXISTS`` before the write (redis-py's Script objects in a pipeline ask it
    every time: a round trip more per batch); a second, different outcome for the same
    request is refused and the first stands."""
    app = make_app(own_redis.s, name="test-results", role="worker")
    admin = redis.Redis.from_url(own_redis.s.redis_url("admin"))
    writer = ResultWriter(app)
    ids = [f"results-{i}" for i in range(3)]
    writer.write([Outcome(ids[0], result={"warm": 1})])  # the script is loaded by now
    admin.config_resetstat()

    written = writer.write([Outcome(i, result={"n": n}) for n, i in enumerate(ids[1:])])
    again = writer.write([Outcome(ids[1], error=DeadlineExceeded("late copy"))])

    calls = _calls(admin)
    assert written == [True, True]
    assert again == [False]
    assert calls.get("evalsha") == 3
    assert not {"script", "script|exists", "script|load"} & set(calls), calls
    assert _stored(admin, app, ids[1])["status"] == "SUCCESS"
    assert _stored(admin, app, ids[1])["result"] == {"n": 0}
    assert writer.duplicates == 1


def test_results_are_stored_after_the_server_flushed_its_scripts(own_redis: Any) -> None:
    """A restarted (or failed-over) Redis has no scripts: the write loads it and is
    repeated, and every result is stored once."""
    app = make_app(own_redis.s, name="test-results", role="worker")
    admin = redis.Redis.from_url(own_redis.s.redis_url("admin"))
    writer = ResultWriter(app)
    writer.write([Outcome("flush-warm", result={"warm": 1})])
    admin.script_flush()
    admin.config_resetstat()

    ids = [f"flush-{i}" for i in range(4)]
    written = writer.write([Outcome(i, result={"i": i}) for i in ids])

    assert written == [True] * 4
    assert [_stored(admin, app, i)["result"] for i in ids] == [{"i": i} for i in ids]
    calls = _calls(admin)
    assert calls.get("script|load", calls.get("script")) == 1, calls
    assert calls.get("evalsha") == 8  # 4 refused with NOSCRIPT, then 4 that ran

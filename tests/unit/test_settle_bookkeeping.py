"""What settling does its own way, to do less per request, equals what Celery does: a group's
bookkeeping (``workers.consumer.engine.Engine``: ``task_accepted``, ``task_ready``) and the
result keys (``ResultWriter.result_key``)."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.worker import state as worker_state

from workers.batching.completion import ResultWriter
from workers.consumer.engine import Engine


class Req:
    """What Celery's bookkeeping reads of a request: its id and task name (hashable, and
    weakly referenced by the worker's sets)."""

    def __init__(self, task_id: str, name: str) -> None:
        self.id, self.name = task_id, name


def _state() -> tuple[Any, ...]:
    return (
        dict(worker_state.requests),
        set(worker_state.active_requests),
        set(worker_state.reserved_requests),
        set(worker_state.scheduled_requests),
        Counter(worker_state.total_count),
        list(worker_state.all_total_count),
        set(worker_state.successful_requests),
    )


@pytest.fixture
def clean_state() -> Iterator[None]:
    worker_state.reset_state()
    yield
    worker_state.reset_state()


def _run(accepted: list[Req], ready: list[Req], reserved: list[Req], group: bool) -> Any:
    worker_state.reset_state()
    for r in reserved:
        worker_state.task_reserved(r)
    if group:
        Engine.task_accepted(accepted)
        Engine.task_ready(ready)
    else:
        for r in accepted:
            worker_state.task_accepted(r)
        for r in ready:
            worker_state.task_ready(r)
    return _state()


def test_group_bookkeeping_equals_celerys_per_request_functions(clean_state: None) -> None:
    reqs = [Req(f"id{i}", "fleet.text" if i % 3 else "fleet.image") for i in range(12)]
    reserved = reqs[4:]  # still in the prefetch window
    accepted = reqs[:8]
    ready = [reqs[1], reqs[0], reqs[5], reqs[9], Req("never-seen", "fleet.text")]
    celery = _run(accepted, ready, reserved, group=False)
    ours = _run(accepted, ready, reserved, group=True)
    assert ours == celery
    assert ours[4] == Counter({"fleet.text": 5, "fleet.image": 3}) and ours[5] == [8]
    assert "id0" not in ours[0] and "id2" in ours[0]


@pytest.mark.parametrize("global_prefix", ["", "tenant-a"])
def test_result_keys_are_the_backends(global_prefix: str) -> None:
    app = Celery("t", broker="memory://", backend="redis://127.0.0.1:1/0", set_as_current=False)
    if global_prefix:
        app.conf.result_backend_transport_options = {"global_keyprefix": global_prefix}
    writer = ResultWriter(app)  # no Redis: keys are made, nothing is sent
    backend = app.backend
    assert writer.result_key is not backend.get_key_for_task  # the prefix is read once
    for task_id in [str(uuid.uuid4()), "é-ünïcode", "x" * 300]:
        assert writer.result_key(task_id) == backend.get_key_for_task(task_id)
    some = uuid.uuid4()
    assert writer.result_key(some) == backend.get_key_for_task(some)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        writer.result_key("")

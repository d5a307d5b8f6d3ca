"""Store a batch's results in as few Redis round trips as Celery's Redis backend allows.

Celery's own ``backend.store_result`` costs two round trips per task (a GET to refuse
overwriting a SUCCESS, then SETEX + PUBLISH). A batch of N here costs one pipeline: SETEX and
PUBLISH for every member. The stored document is Celery's result meta, so ``AsyncResult``,
Flower and clients in other languages read it unchanged::

    {"status": "SUCCESS" | "FAILURE", "result": <value or exception dict>,
     "traceback": null, "children": [], "date_done": "<ISO 8601 UTC>", "task_id": "<id>"}

A failure's ``result`` is Celery's JSON exception encoding with the fleet's code added:
``{"exc_type": "ImageDecodeError", "exc_message": ["<message>", "IMAGE_DECODE"],
"exc_module": "shared.errors"}``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from celery import Celery

from shared.errors import FleetError


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request's final state: ``result`` on success, else ``error``."""

    task_id: str
    result: dict[str, Any] | None = None
    error: FleetError | None = None

    @property
    def state(self) -> str:
        return "SUCCESS" if self.error is None else "FAILURE"


def exception_dict(err: FleetError) -> dict[str, Any]:
    """Celery's JSON encoding of an exception (``exc_type``, ``exc_message``, ``exc_module``)."""
    return {
        "exc_type": type(err).__name__,
        "exc_message": [err.message, err.code],
        "exc_module": type(err).__module__,
    }


class ResultWriter:
    """Writes :class:`Outcome` lists to Celery's Redis result backend in one pipeline."""

    def __init__(self, app: Celery) -> None:
        self.backend = app.backend
        self.expires_s = int(self.backend.expires or 0)
        self.failure_expires_s = int(getattr(self.backend, "failure_expires", 0) or self.expires_s)

    def meta(self, o: Outcome) -> dict[str, Any]:
        return {
            "status": o.state,
            "result": o.result if o.error is None else exception_dict(o.error),
            "traceback": None,
            "children": [],
            "date_done": datetime.now(UTC).isoformat(),
            "task_id": o.task_id,
        }

    def write_progress(self, task_id: str, progress: dict[str, Any]) -> None:
        """Store a ``PROGRESS`` state whose ``result`` is ``progress`` (e.g. done/total)."""
        meta = {
            "status": "PROGRESS",
            "result": progress,
            "traceback": None,
            "children": [],
            "date_done": None,
            "task_id": task_id,
        }
        key = self.backend.get_key_for_task(task_id)
        self.backend.client.setex(key, self.expires_s or 86400, self.backend.encode(meta))

    def write(self, outcomes: Sequence[Outcome], also_delete: Sequence[str] = ()) -> None:
        """Store every outcome (SETEX + PUBLISH each) in one round trip.

        ``also_delete``: keys to delete in the same pipeline (the requests' in-flight
        counters).

        Raises:
            redis.RedisError: the pipeline failed; nothing may be acked then (the messages
                come back after the visibility timeout: at-least-once).
        """
        if not outcomes:
            return
        with self.backend.client.pipeline(transaction=False) as pipe:
            for o in outcomes:
                key = self.backend.get_key_for_task(o.task_id)
                value = self.backend.encode(self.meta(o))
                ttl = self.failure_expires_s if o.error is not None else self.expires_s
                if ttl:
                    pipe.setex(key, ttl, value)
                else:
                    pipe.set(key, value)
                pipe.publish(key, value)
            if also_delete:
                pipe.delete(*also_delete)
            pipe.execute()

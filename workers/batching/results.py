"""Store a batch's final results, the first one of each request winning, in one round trip.

Delivery is at-least-once (a lost ack, a lapsed lease, a duplicate publish), so a request may
run twice; what a client observes must be one final result. Each final write is one small
Lua script (``_WRITE_FIRST``): if ``fleet:final:<id>`` is absent, the result's SETEX, then
the marker ``SET fleet:final:<id> <write token>``, then PUBLISH, atomically. A later copy's
write changes nothing (a SUCCESS is never overwritten by a redelivered copy's
``DEADLINE_EXCEEDED``). The marker holds the writer's token (one per outcome, kept across its
retries): a write that ran but whose reply was lost (Redis shut down or the connection
dropped after executing it) is recognised as this writer's own when it is retried, and
reported stored, not as a duplicate.

A script is atomic against other clients but not all-or-nothing: Redis keeps the writes a
script made before one of its commands was refused (an ACL rule, a full disk, a replica
turned read-only). So the document is written before the marker: a script refused halfway
leaves at most a document without a marker, which the retry writes again together with its
marker, never a marker without a document (a request that would read ``PENDING`` for the
marker's whole TTL while every copy of it is acked as a duplicate). Celery's own
``backend.store_result`` refuses only to overwrite a SUCCESS, and with a GET before the write
(two round trips, not atomic). A batch of N costs one pipeline. ``PROGRESS`` states are not
final: they are plain SETEX and never overwrite a final result (``_WRITE_PROGRESS``).

The stored document is Celery's result meta, so ``AsyncResult``, Flower and clients in other
languages read it unchanged::

    {"status": "SUCCESS" | "FAILURE", "result": <value or exception dict>,
     "traceback": null, "children": [], "date_done": "<ISO 8601 UTC>", "task_id": "<id>"}

A failure's ``result`` is Celery's JSON exception encoding with the fleet's code added
(``shared.errors.error_to_wire``): ``{"exc_type": "ImageDecodeError", "exc_message":
["<message>", "IMAGE_DECODE"], "exc_module": "shared.errors"}``.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources
from typing import TYPE_CHECKING, Any, Protocol

from shared import keys, schema
from shared.errors import FleetError, error_to_wire

log = logging.getLogger("fleet.results")
_LUA = resources.files("workers.batching")

if TYPE_CHECKING:
    from shared.redis_client import Waiter

# The final write and the progress write (``results_write_first.lua``,
# ``results_write_progress.lua``: their KEYS, ARGV, replies and keys in their headers).
_WRITE_FIRST = _LUA.joinpath("results_write_first.lua").read_text("utf-8")

_WRITE_PROGRESS = _LUA.joinpath("results_write_progress.lua").read_text("utf-8")


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request's final state: ``result`` on success, else ``error``."""

    task_id: str
    result: dict[str, Any] | None = None
    error: FleetError | None = None
    keep_existing: bool = False  # a stored document stands (Celery's REVOKED)

    @property
    def state(self) -> str:
        return "SUCCESS" if self.error is None else "FAILURE"


def new_token() -> str:
    """A final write's token: random, 16 hex digits (never the ``"1"`` a producer's cancel
    writes)."""
    return secrets.token_hex(8)


exception_dict = error_to_wire
"""Celery's JSON encoding of an exception with the fleet's code (``shared.errors``)."""


class HasBackend(Protocol):
    """The worker's Celery app, as the writer sees it: its Redis result backend (``expires``,
    ``serializer``, ``encode``, ``client``, ``get_key_for_task``). Typed structurally, so this
    module imports no Celery."""

    backend: Any


class ResultWriter:
    """Writes :class:`Outcome` lists to Celery's Redis result backend in one pipeline.

    ``waiter`` (Redis behind Sentinel): the pipeline ends with ``WAIT``, so results are on a
    replica before the caller acks their messages; a failover after the ack cannot lose a
    result whose message is gone (``shared.redis_client.Waiter``). Their ``PUBLISH`` follows
    once ``WAIT`` confirmed them (one more round trip): a write a failover then discards
    (it raises ``ReplicationUncertain``, nothing is acked, the request runs again) was never
    announced, so a subscribed client sees one final result, not two.
    """

    def __init__(self, app: HasBackend, waiter: Waiter | None = None) -> None:
        self.waiter = waiter
        self.backend = app.backend
        self.expires_s = int(self.backend.expires or 0)
        self.failure_expires_s = int(getattr(self.backend, "failure_expires", 0) or self.expires_s)
        self._scripts: tuple[Any, Any] | None = None
        # JSON (the fleet's result_serializer) through shared.schema: the same documents,
        # without a batch's float reprs holding the event loop; another serializer: Celery's.
        self.encode = schema.dumps if self.backend.serializer == "json" else self.backend.encode
        self.duplicates = 0  # final writes refused: the request had its final result already

    def _script(self, i: int) -> Any:
        if self._scripts is None:  # registered on first use: meta() needs no Redis
            client = self.backend.client
            self._scripts = (
                client.register_script(_WRITE_FIRST),
                client.register_script(_WRITE_PROGRESS),
            )
        return self._scripts[i]

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
        self._script(1)(
            keys=[keys.final_key(task_id), key],
            args=[self.encode(meta), self.expires_s or 86400],
        )

    def write(
        self,
        outcomes: Sequence[Outcome],
        also_delete: Sequence[str] = (),
        tokens: Sequence[str] | None = None,
    ) -> list[bool]:
        """Store every outcome whose request has no final result yet, in one round trip.

        Args:
            outcomes: the final outcomes.
            also_delete: keys to delete in the same pipeline (the requests' in-flight
                counters).
            tokens: one write token per outcome (:func:`new_token`; outcomes of different
                requests may share one), the same on every retry of that outcome's write: a
                retry after a lost reply then finds its own write and reports it stored.
                ``None``: one fresh token for the call (no retry to recognise).

        Returns:
            For each outcome, whether it is stored (``False``: another write's final result
            stands and this one was dropped).

        Raises:
            redis.RedisError: the pipeline failed; nothing may be acked then.
        """
        if not outcomes:
            return []
        import redis  # here, not at import: the engine's Celery-free parts import this module

        from shared.redis_client import execute_waiting

        client = self.backend.client
        publish_later = self.waiter is not None
        if tokens is None:
            tokens = [new_token()] * len(outcomes)
        stored: list[tuple[str, bytes | str]] = []
        calls: list[tuple[list[str], list[Any]]] = []
        for o, token in zip(outcomes, tokens, strict=True):
            key = self.backend.get_key_for_task(o.task_id)
            value = self.encode(self.meta(o))
            stored.append((key, value))
            ttl = self.failure_expires_s if o.error is not None else self.expires_s
            calls.append(
                (
                    [keys.final_key(o.task_id), key],
                    [
                        value,
                        ttl,
                        "1" if o.keep_existing else "0",
                        "0" if publish_later else "1",
                        token,
                    ],
                )
            )
        sha = self._script(0).sha
        for attempt in (1, 2):
            # EVALSHA straight into the pipeline: redis-py's Script objects in a pipeline
            # first ask SCRIPT EXISTS, one more round trip for every write.
            with client.pipeline(transaction=False) as pipe:
                for k, a in calls:
                    pipe.evalsha(sha, len(k), *k, *a)
                if also_delete:
                    pipe.delete(*also_delete)
                try:
                    replies = execute_waiting(client, pipe, self.waiter)
                    break
                except redis.exceptions.NoScriptError:
                    # Not loaded on this server (it restarted, failed over, or flushed its
                    # scripts): nothing ran but the deletes, which repeat harmlessly.
                    if attempt == 2:
                        raise
                    client.script_load(_WRITE_FIRST)
        written = [bool(r) for r in replies[: len(outcomes)]]
        # A 2 (this token's earlier write, its reply lost) is announced here too when the
        # announcement waits for a replica: the earlier attempt never got that far.
        if publish_later and any(written):
            # The results are stored and replicated: a lost announcement costs only
            # subscribers a wait (Celery's result consumer reads stored results when it
            # subscribes again), never the results: the batch is acked all the same.
            try:
                with client.pipeline(transaction=False) as pipe:
                    for (key, value), w in zip(stored, written, strict=True):
                        if w:
                            pipe.publish(key, value)
                    pipe.execute()
            except redis.RedisError as exc:
                log.warning("announcing %d stored results failed: %s", sum(written), exc)
        self.duplicates += written.count(False)
        return written

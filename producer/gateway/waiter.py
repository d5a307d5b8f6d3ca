"""Waiting for a job's result documents on the gateway's ``AsyncFleetClient``: its result
subscriptions (``producer.client.subscriptions``), no connection or listener of the gateway's
own, and nothing polls.

Workers store every result document of a request (``celery-task-meta-<id>``: a video's
``PROGRESS`` documents, at most four a second, then the final one) and ``PUBLISH`` it on the
channel of the same name; so does a cancel (``AsyncFleetClient.cancel``). A
:class:`ResultWatch` joins the job's channel on the client's one pubsub connection (a channel
several requests wait on is subscribed once), waits for Redis' confirmation, then reads the
stored document once (:meth:`ResultWatch.stored`: one stored before the subscription took
effect), and after that takes what is published (:meth:`ResultWatch.published`), and the
stored document again after a lost connection (the client's subscriptions read it when Redis
confirms the resubscription).

The documents are read here as JSON, not through ``AsyncResultHandle``: a job's views need
Celery's meta (state, progress, the stored result), and that handle settles a request as its
producer does, its output segments released once mapped, where a job's result is read again
by every ``GET /v2/jobs/{id}`` until it expires.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from producer.client.results import READY_STATES
from shared import schema

if TYPE_CHECKING:
    from producer.client import AsyncFleetClient
    from producer.client.subscriptions import Listening

__all__ = ["FINAL_STATES", "ResultWatch", "decode_meta", "final_document", "is_final"]

FINAL_STATES = READY_STATES  # SUCCESS, FAILURE, REVOKED


def decode_meta(raw: bytes | str | None) -> dict[str, Any] | None:
    """A stored result document (JSON), or ``None`` if absent or not JSON."""
    if raw is None:
        return None
    try:
        meta = schema.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return meta if isinstance(meta, dict) else None


def is_final(meta: dict[str, Any] | None) -> bool:
    """Whether ``meta`` is a final result document."""
    return meta is not None and meta.get("status") in FINAL_STATES


class ResultWatch:
    """One job's result channel, subscribed while in ``async with``.

    Args:
        client: the gateway's client (its ``subscriptions`` and ``redis``).
        task_id: the job's id.
        on_final: called with ``task_id`` the first time this watch reads a final document
            (the gateway's service-rate meters count the completion).
    """

    def __init__(
        self,
        client: AsyncFleetClient,
        task_id: str,
        on_final: Callable[[str], None] | None = None,
    ) -> None:
        self.client = client
        self.task_id = task_id
        self.channel = schema.result_key(task_id)
        self._on_final = on_final
        self._listening: Listening | None = None

    async def __aenter__(self) -> ResultWatch:
        """Subscribe the channel (its confirmation comes later: :meth:`stored` waits for it).

        Raises:
            redis.RedisError, OSError: the ``SUBSCRIBE`` could not be sent.
        """
        self._listening = await self.client.subscriptions.join(self.channel)
        return self

    async def __aexit__(self, *_exc: object) -> None:
        """Leave the channel, also when the caller is cancelled (an SSE client gone: Starlette
        cancels the stream's scope, which would cancel any wait in it)."""
        if self._listening is not None:
            listening, self._listening = self._listening, None
            await asyncio.shield(self.client.subscriptions.leave(listening))

    async def stored(self, timeout_s: float) -> dict[str, Any] | None:
        """The stored document, read once Redis confirmed the subscription (waited for at most
        ``timeout_s``: past it, read anyway; the caller's budget is spent), ``None``: none.

        Raises:
            redis.RedisError, OSError: the read failed.
        """
        assert self._listening is not None, "use ResultWatch in async with"
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._listening.ready(), max(timeout_s, 0.0))
        return self._seen(decode_meta(await self.client.redis.get(self.channel)))

    async def published(self, timeout_s: float) -> dict[str, Any] | None:
        """The next document published on the channel (or read again after a reconnect), or
        ``None`` when none came within ``timeout_s`` (or it is not JSON)."""
        assert self._listening is not None, "use ResultWatch in async with"
        try:
            raw = await asyncio.wait_for(self._listening.next(), max(timeout_s, 0.0))
        except TimeoutError:
            return None
        return self._seen(decode_meta(raw))

    def _seen(self, meta: dict[str, Any] | None) -> dict[str, Any] | None:
        if is_final(meta) and self._on_final is not None:
            on_final, self._on_final = self._on_final, None
            on_final(self.task_id)
        return meta


async def final_document(
    client: AsyncFleetClient,
    task_id: str,
    timeout_s: float,
    on_final: Callable[[str], None] | None = None,
) -> dict[str, Any] | None:
    """``task_id``'s final result document, or ``None`` after ``timeout_s`` (0: the stored
    one, read once, nothing subscribed). ``on_final`` as :class:`ResultWatch` takes it.

    Raises:
        redis.RedisError, OSError: Redis could not be asked.
    """
    if timeout_s <= 0:
        meta = decode_meta(await client.redis.get(schema.result_key(task_id)))
        if not is_final(meta):
            return None
        if on_final is not None:
            on_final(task_id)
        return meta
    end = time.monotonic() + timeout_s
    async with ResultWatch(client, task_id, on_final) as watch:
        meta = await watch.stored(timeout_s)
        while not is_final(meta):
            left = end - time.monotonic()
            if left <= 0:
                return None
            meta = await watch.published(left)
        return meta

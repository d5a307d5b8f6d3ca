"""Result notifications for the asyncio client: one pubsub connection per
``AsyncFleetClient``, fanned out to the requests waiting on it.

Workers store a request's result document (Celery's result meta, under
``celery-task-meta-<id>``) and ``PUBLISH`` it on the channel of the same name: every
``PROGRESS`` document (``workers/batching/results_write_progress.lua``) and the final one
(``results_write_first.lua``; a producer's cancel too, ``producer.client.results.Revocation``).
A waiter (:meth:`Subscriptions.join`) ``SUBSCRIBE``s to its request's channel, waits until
Redis confirms the subscription (:meth:`Listening.ready`), and only then reads the stored
document once (the caller does): a document stored before the subscription took effect is
read, one stored after it is published to it. Nothing polls.

A lost connection: redis-py's pubsub reconnects and subscribes again to every channel it
had; Redis confirms each one again, and a confirmation of a channel confirmed before makes
this module read that channel's stored document once more and hand it to its waiters (a
document published while the connection was away is stored). A channel several waiters share
(one request waited on twice) is subscribed once, and unsubscribed when its last waiter
leaves; subscribing and unsubscribing take turns (one lock), so Redis sees them in the order
they were decided.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

__all__ = ["READ_TIMEOUT_S", "RETRY_PAUSE_S", "Listening", "Subscriptions"]

log = logging.getLogger("fleet.client")

READ_TIMEOUT_S = 1.0  # the reader returns at least this often (redis-py's health checks)
RETRY_PAUSE_S = 0.5  # after a failed read, before the next (which reconnects)


@dataclass(eq=False)
class _Channel:
    """One subscribed channel: its waiters' queues, and the ``SUBSCRIBE``s sent for it that
    Redis has not confirmed yet."""

    queues: list[asyncio.Queue[bytes]] = field(default_factory=list)
    confirmed: asyncio.Event = field(default_factory=asyncio.Event)
    pending: int = 0


@dataclass(eq=False)
class Listening:
    """One waiter on a channel (:meth:`Subscriptions.join`)."""

    name: str
    entry: _Channel
    queue: asyncio.Queue[bytes]

    async def ready(self) -> None:
        """Returns once Redis confirmed the channel's subscription: what is published on it
        from now on reaches :meth:`next`."""
        await self.entry.confirmed.wait()

    async def next(self) -> bytes:
        """The next document published on the channel (or read again after a reconnect)."""
        return await self.queue.get()


class Subscriptions:
    """The channels an asyncio client waits on, on one pubsub connection of ``redis`` (a
    ``redis.asyncio.Redis``; its pool also serves the reads after a reconnect)."""

    def __init__(self, redis: Any) -> None:
        self.redis = redis
        self._pubsub: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._channels: dict[str, _Channel] = {}
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()

    async def join(self, name: str) -> Listening:
        """Wait on channel ``name``: subscribed once for all its waiters (Redis confirms it:
        :meth:`Listening.ready`); call :meth:`leave` when done.

        Raises:
            redis.RedisError, OSError: the ``SUBSCRIBE`` could not be sent.
        """
        async with self._lock:
            entry = self._channels.get(name)
            if entry is None:
                entry = self._channels[name] = _Channel()
                entry.pending += 1  # the confirmation may be read before the send returns
                try:
                    await self._subscribe(name)
                except BaseException:
                    entry.pending -= 1
                    if not entry.queues and entry.pending == 0:
                        del self._channels[name]
                    raise
            listening = Listening(name, entry, asyncio.Queue())
            entry.queues.append(listening.queue)
            return listening

    async def leave(self, listening: Listening) -> None:
        """Stop waiting; the channel is unsubscribed when its last waiter left."""
        async with self._lock:
            entry = listening.entry
            with contextlib.suppress(ValueError):
                entry.queues.remove(listening.queue)
            await self._drop_if_idle(listening.name, entry)

    async def _subscribe(self, name: str) -> None:
        if self._pubsub is None:
            self._pubsub = self.redis.pubsub()
        await self._pubsub.subscribe(name)
        if self._reader is None:  # the pubsub has its connection now
            self._reader = asyncio.create_task(self._read(), name="fleet-client-results")

    async def _drop_if_idle(self, name: str, entry: _Channel) -> None:
        """Unsubscribe ``name`` when no waiter is left and no confirmation is due (one still
        due: done when it arrives). Called under the lock."""
        if entry.queues or entry.pending or self._channels.get(name) is not entry:
            return
        del self._channels[name]
        try:
            await self._pubsub.unsubscribe(name)
        except Exception as exc:  # the connection is away: its reconnect will not resubscribe
            log.debug("unsubscribing %s: %s", name, exc)

    async def close(self) -> None:
        """Stop reading and close the pubsub connection."""
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
            self._reader = None
        for task in list(self._tasks):
            task.cancel()
        if self._pubsub is not None:
            with contextlib.suppress(Exception):
                await self._pubsub.aclose()
            self._pubsub = None
        self._channels.clear()

    # -- the reader ------------------------------------------------------------------------
    async def _read(self) -> None:
        while True:
            try:
                message = await self._pubsub.get_message(timeout=READ_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the next read reconnects (redis-py resubscribes)
                log.warning("result notifications: %s; reconnecting", exc)
                await asyncio.sleep(RETRY_PAUSE_S)
                continue
            if message is not None:
                self._dispatch(message)

    def _dispatch(self, message: dict[str, Any]) -> None:
        name = message.get("channel")
        if isinstance(name, bytes):
            name = name.decode()
        entry = self._channels.get(name) if isinstance(name, str) else None
        if entry is None:
            return
        kind = message.get("type")
        if kind == "message":
            for queue in entry.queues:
                queue.put_nowait(message["data"])
        elif kind == "subscribe" and entry.pending:
            entry.pending -= 1
            entry.confirmed.set()
            if not entry.queues and not entry.pending:  # its waiters left before
                self._spawn(self._drop_later(name, entry))
        elif kind == "subscribe":  # subscribed again after a reconnect: read what was missed
            self._spawn(self._read_again(name, entry))

    def _spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drop_later(self, name: str, entry: _Channel) -> None:
        async with self._lock:
            await self._drop_if_idle(name, entry)

    async def _read_again(self, name: str, entry: _Channel) -> None:
        try:
            raw = await self.redis.get(name)
        except Exception as exc:  # away again: the next confirmation reads it
            log.warning("reading %s after a reconnect: %s", name, exc)
            return
        if raw is not None:
            for queue in entry.queues:
                queue.put_nowait(raw)

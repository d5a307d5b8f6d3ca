"""Waiting for final results without polling: one shared pubsub connection per process.

Workers store a final result with SETEX and PUBLISH it on the result key
(``celery-task-meta-<id>``; ``workers.batching.completion``), and so does ``FleetClient.cancel``. A
waiter SUBSCRIBEs to that channel on the process's one pubsub connection (the producer's Redis user
may SUBSCRIBE, not PSUBSCRIBE), waits for the subscription's confirmation, then GETs the key
once (a result stored before the subscription took effect), and otherwise is woken by the
message. Several waiters on one id share the subscription. After a reconnect the listener
re-reads every waited key (MGET), so a result published while it was away is not missed; a
slow GET every ``SAFETY_POLL_S`` covers anything else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from shared import schema

log = logging.getLogger("fleet.gateway")
FINAL_STATES = frozenset({"SUCCESS", "FAILURE", "REVOKED"})
SAFETY_POLL_S = 5.0
SUBSCRIBE_CONFIRM_S = 1.0


def decode_meta(raw: bytes | str | None) -> dict[str, Any] | None:
    """A stored result document (JSON), or ``None`` if absent or not JSON."""
    if raw is None:
        return None
    try:
        meta = schema.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return meta if isinstance(meta, dict) else None


class ResultWaiter:
    """Futures for final results, fed by one pubsub listener task.

    Args:
        redis: a ``redis.asyncio.Redis`` (its pool also serves the GETs).
        on_final: called with ``(task_id, meta)`` once per final result a waiter received
            (the gateway's service-rate meter).
    """

    def __init__(
        self, redis: Any, on_final: Callable[[str, dict[str, Any]], None] | None = None
    ) -> None:
        self.redis = redis
        self.on_final = on_final
        self.pubsub = redis.pubsub()
        self._futures: dict[str, list[asyncio.Future[dict[str, Any]]]] = {}
        self._confirmed: dict[str, asyncio.Event] = {}
        self._task: asyncio.Task[None] | None = None
        self._reconnected = False

    async def start(self) -> None:
        await self.pubsub.connect()
        self._task = asyncio.create_task(self._listen(), name="gateway-result-listener")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        with contextlib.suppress(Exception):
            await self.pubsub.aclose()

    @property
    def waiting(self) -> int:
        return len(self._futures)

    async def wait(self, task_id: str, timeout_s: float) -> dict[str, Any] | None:
        """The final result document of ``task_id``, or ``None`` after ``timeout_s``.

        Raises:
            redis errors: the GET failed (Redis away).
        """
        channel = schema.result_key(task_id)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[dict[str, Any]] = loop.create_future()
        waiters = self._futures.setdefault(channel, [])
        waiters.append(fut)
        try:
            if len(waiters) == 1:
                event = self._confirmed[channel] = asyncio.Event()
                await self.pubsub.subscribe(channel)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), SUBSCRIBE_CONFIRM_S)
            meta = decode_meta(await self.redis.get(channel))
            if meta is not None and meta.get("status") in FINAL_STATES:
                return meta
            end = time.monotonic() + timeout_s
            while True:
                left = end - time.monotonic()
                if left <= 0:
                    return None
                try:
                    return await asyncio.wait_for(asyncio.shield(fut), min(left, SAFETY_POLL_S))
                except TimeoutError:
                    meta = decode_meta(await self.redis.get(channel))
                    if meta is not None and meta.get("status") in FINAL_STATES:
                        return meta
        finally:
            waiters.remove(fut)
            if not fut.done():
                fut.cancel()
            if not waiters:
                del self._futures[channel]
                self._confirmed.pop(channel, None)
                with contextlib.suppress(Exception):
                    await self.pubsub.unsubscribe(channel)

    def _deliver(self, channel: str, meta: dict[str, Any]) -> None:
        futs = self._futures.get(channel)
        if not futs:
            return
        delivered = False
        for f in futs:
            if not f.done():
                f.set_result(meta)
                delivered = True
        if delivered and self.on_final is not None:
            task_id = channel[len(schema.RESULT_KEY_PREFIX) :]
            try:
                self.on_final(task_id, meta)
            except Exception:
                log.exception("on_final failed")

    async def _listen(self) -> None:
        while True:
            try:
                if self._reconnected:
                    self._reconnected = False
                    await self._reread()
                msg = await self.pubsub.get_message(timeout=1.0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a dropped connection: redis-py resubscribes on reconnect
                log.warning("result listener: %s; reconnecting", exc)
                self._reconnected = True
                await asyncio.sleep(0.5)
                continue
            if msg is None:
                continue
            kind = msg.get("type")
            channel = msg.get("channel")
            if isinstance(channel, bytes):
                channel = channel.decode()
            if kind == "subscribe":
                ev = self._confirmed.get(channel)
                if ev is not None:
                    ev.set()
            elif kind == "message" and channel in self._futures:
                meta = decode_meta(msg.get("data"))
                if meta is not None and meta.get("status") in FINAL_STATES:
                    self._deliver(channel, meta)

    async def _reread(self) -> None:
        """After a reconnect: results stored while the listener was away."""
        channels = list(self._futures)
        if not channels:
            return
        values = await self.redis.mget(channels)
        for channel, raw in zip(channels, values, strict=True):
            meta = decode_meta(raw)
            if meta is not None and meta.get("status") in FINAL_STATES:
                self._deliver(channel, meta)

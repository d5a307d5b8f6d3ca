"""How ``FleetClient.publish_many`` puts chunks of messages on Redis (``producer.client.publish``
drives it): one Redis connection per call (:class:`Line`), each chunk one ``MULTI``/``EXEC``
transaction (:class:`Chunk`) sent before the next chunk is built and its replies read after,
and the queue-length check's ``LLEN``s (:class:`DepthCheck`) on the same connection, asked
before the first chunk is built and judged before it is sent.

Faults: an attempt that fails drops the connection (its replies may be left unread on it); the
next attempt (``Connection.ensure``'s retry, after kombu reconnected) takes a fresh one from the
channel's pool and sends the transaction again (:func:`attempt`).

Private kombu/Celery names (read from kombu 5.7.0; ``tests/unit/test_private_names.py``):
    kombu.transport.redis.Channel: _get_publish_topics (new in 5.7)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from producer.client.wire import Outgoing
from shared.errors import QueueFull
from shared.ha import WaitingPut
from shared.redis_client import SentTransaction, send_transaction
from shared.schema import TaskEnvelope

if TYPE_CHECKING:
    from shared.settings import Settings

__all__ = ["Chunk", "DepthCheck", "Line", "Nothing", "Pusher", "attempt"]


class Nothing:
    """What kombu's ``Connection.ensure`` revives after a reconnect: nothing (each attempt
    takes the connection's channel afresh)."""

    def revive(self, channel: Any) -> None:
        """Called with the new channel after a reconnect; nothing to do."""


class Line:
    """One ``publish_many`` call's Redis connection: taken from the kombu connection's
    channel's client pool when first needed, kept for the call (one pool checkout, not one
    per transaction), dropped after a fault, given back by :meth:`close`."""

    def __init__(self, kconn: Any) -> None:
        self.kconn = kconn
        self.client: Any = None
        self.conn: Any = None

    def send(self, commands: Sequence[tuple[Any, ...]], atomic: bool = True) -> SentTransaction:
        """Send ``commands`` as one transaction (``atomic=False``: a plain pipeline;
        ``WAIT`` after it when the channel waits for a replica: ``shared.ha.WaitingPut``);
        read its replies before the next send's.

        Raises:
            redis.ConnectionError, redis.TimeoutError: the send failed.
        """
        channel = self.kconn.default_channel
        client = channel.client  # the channel's cached client: kombu's would be one per call
        if self.conn is None or client is not self.client:
            self.close()
            self.client, self.conn = client, client.connection_pool.get_connection()
        waiter = None
        if atomic and isinstance(channel, WaitingPut):  # writes: confirmed by a replica
            waiter = channel._put_waiter()
        return send_transaction(client, commands, waiter, self.conn, atomic)

    def channel(self) -> Any:
        """The kombu connection's channel (for its publish topics)."""
        return self.kconn.default_channel

    def drop(self) -> None:
        """After a fault: disconnect (replies may be left on it) and give it back."""
        if self.conn is not None:
            self.conn.disconnect()
        self.close()

    def close(self) -> None:
        """Give the connection back to its pool (its replies all read)."""
        conn, self.conn = self.conn, None
        if conn is not None:
            self.client.connection_pool.release(conn)


class Chunk:
    """One transaction of ``publish_many``: a chunk's pushes and its events' group message,
    or the queue-length check's ``LLEN``s (``commands`` given: read-only, sent as a plain
    pipeline), and the transaction once
    sent (or why the send failed) until its replies are read (:func:`attempt`)."""

    def __init__(
        self,
        part: list[Outgoing],
        group: bytes | None,
        exchange: str,
        commands: list[tuple[Any, ...]] | None = None,
    ) -> None:
        self.part, self.group, self.exchange = part, group, exchange
        self._commands = commands
        self.writes = commands is None  # pushes: a transaction; else reads: a pipeline
        self.sent: SentTransaction | BaseException | None = None

    def commands(self, channel: Any) -> list[tuple[Any, ...]]:
        """An ``LPUSH`` per list (messages in order), then the group's ``PUBLISH``es (on the
        event exchange's ``task.sent`` topics, kombu's fanout topics)."""
        if self._commands is not None:
            return self._commands
        lists: dict[str, list[bytes]] = {}
        for m in self.part:
            lists.setdefault(m.key, []).append(m.payload)
        commands: list[tuple[Any, ...]] = [("LPUSH", k, *v) for k, v in lists.items()]
        if self.group is not None:
            topics = channel._get_publish_topics(self.exchange, "task.sent")
            commands += [("PUBLISH", t, self.group) for t in topics]
        return commands

    def send(self, line: Line) -> None:
        """The first attempt's send; a failure is kept for :func:`attempt` to raise (where
        ``Connection.ensure`` retries it)."""
        try:
            self.sent = line.send(self.commands(line.channel()), self.writes)
        except Exception as exc:
            self.sent = exc

    def abandon(self, line: Line) -> None:
        """Its replies will not be read: the connection is dropped."""
        if isinstance(self.sent, SentTransaction):
            line.drop()
        self.sent = None


def attempt(kconn: Any, line: Line, job: Chunk) -> list[Any]:
    """One attempt at ``job`` (``Connection.ensure`` retries it; ``kconn`` is its kombu
    connection): the replies of the transaction :meth:`Chunk.send` sent (the first
    attempt), or of the transaction sent again now (a retry).

    Raises:
        what the send or the replies raised (the connection dropped).
    """
    sent, job.sent = job.sent, None
    try:
        if isinstance(sent, BaseException):
            raise sent
        if sent is None:
            sent = line.send(job.commands(line.channel()), job.writes)
        return sent.replies()
    except BaseException:
        line.drop()
        raise


class Pusher:
    """The chunks of one ``publish_many`` call on kombu connection ``kconn``: one
    :class:`Line`, each attempt through ``Connection.ensure`` with the publish retry
    ``policy``; ``group`` makes a chunk's events' message (``PayloadBuilder.sent_group``),
    published on the event ``exchange``."""

    def __init__(
        self,
        kconn: Any,
        policy: dict[str, Any],
        exchange: str,
        group: Callable[[list[bytes]], bytes],
    ) -> None:
        self.kconn, self.exchange, self.group = kconn, exchange, group
        self.line = Line(kconn)
        self.push: Attempt = kconn.ensure(Nothing(), attempt, **policy)
        self.inflight: Chunk | None = None  # sent, its replies not read yet

    def chunks(
        self, messages: Iterator[Outgoing], chunk: int, check: DepthCheck | None
    ) -> Iterator[int]:
        """Send ``messages`` in chunks of ``chunk``, each built while Redis takes the one
        before; yields after each chunk how many are on Redis. ``check`` is asked before
        the first chunk is built and judged before it is sent (``QueueFull``: nothing sent).
        A chunk sent before the next one fails to build is counted, then the error raised.
        """
        sent = 0
        if check is not None:  # asked now, answered while the first chunk is built
            self.inflight = Chunk([], None, self.exchange, check.commands())
            self.inflight.send(self.line)
        part = list(itertools.islice(messages, chunk))
        if check is not None:
            check.judge(self._finish())
        while part:
            events = [m.event for m in part if m.event is not None]
            self.inflight = Chunk(part, self.group(events) if events else None, self.exchange)
            self.inflight.send(self.line)
            failed = None
            try:  # the next chunk is built while Redis takes this one
                following = list(itertools.islice(messages, chunk))
            except Exception as exc:  # this chunk is sent: it is counted first
                following, failed = [], exc
            self._finish()
            sent += len(part)
            yield sent
            if failed is not None:
                raise failed
            part = following

    def _finish(self) -> list[Any]:
        """The in-flight transaction's replies (retried per the policy)."""
        job, self.inflight = self.inflight, None
        assert job is not None
        return self.push(self.kconn, self.line, job)

    def close(self) -> None:
        """Give the connection back (dropped when a transaction's replies are unread)."""
        if self.inflight is not None:
            self.inflight.abandon(self.line)
            self.inflight = None
        self.line.close()


@dataclass(frozen=True)
class DepthCheck:
    """The queue-length limits (``max_queue_length``, ``max_queue_length_by_priority``)
    against one submission: ``rows`` (modality, class label, priority list) are asked with
    ``LLEN`` (:meth:`commands`) and their answers judged (:meth:`judge`)."""

    settings: Settings
    envs: Sequence[TaskEnvelope]
    rows: list[tuple[str, str, str]]

    def commands(self) -> list[tuple[Any, ...]]:
        """One ``LLEN`` per row."""
        return [("LLEN", key) for _, _, key in self.rows]

    def judge(self, counts: Sequence[Any]) -> None:
        """Raises ``QueueFull`` when the submission does not fit (``counts``: the
        ``LLEN`` answers, in ``rows``' order)."""
        depth: dict[str, dict[str, int]] = {}
        for (modality, label, _), n in zip(self.rows, counts, strict=True):
            depth.setdefault(modality, {})[label] = int(n)
        for modality, by_class in depth.items():
            judge(self.settings, modality, by_class, self.envs)


def judge(
    settings: Settings, modality: str, depth: dict[str, int], envs: Sequence[TaskEnvelope]
) -> None:
    """Whether ``envs`` fit ``modality``'s queue of ``depth`` (waiting per class).

    Raises:
        QueueFull: its total, or one priority's, limit would be exceeded.
    """
    cfg = settings.modalities[modality]
    adding = [e for e in envs if e.modality == modality]
    total = sum(depth.values())
    if cfg.max_queue_length and total + len(adding) > cfg.max_queue_length:
        raise QueueFull(
            f"{modality} queue holds {total} requests; the limit is {cfg.max_queue_length}"
        )
    for prio, limit in cfg.max_queue_length_by_priority.items():
        n = sum(e.priority == prio for e in adding)
        if n and depth.get(prio, 0) + n > limit:
            raise QueueFull(
                f"{modality}/{prio} queue holds {depth.get(prio, 0)} requests; the limit is {limit}"
            )


Attempt = Callable[[Any, Line, Chunk], list[Any]]  # attempt, as Connection.ensure wraps it

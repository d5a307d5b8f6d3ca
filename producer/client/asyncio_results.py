"""Reading one request's outcome on asyncio: :class:`AsyncResultHandle` and the
:class:`Event` s it yields (progress, then the final outcome).

What a handle waits on is the request's result channel (``producer.client.subscriptions``:
subscribed, confirmed, then the stored document read once; after that only what workers
publish). The outcome is the blocking client's: ``{"result": ...}`` or ``{"error": {"code",
"message", "type"}}`` from Celery's result meta (``producer.client.results.outcome_from_meta``),
a failure raised as the ``shared.errors.FleetError`` subclass of its code, tensor wire
objects resolved to numpy arrays and the request's /dev/shm inputs released once it is final
(off the event loop, on a thread, when there are any). Import these names from
``producer.client``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from producer.client.results import READY_STATES, outcome_from_meta
from producer.client.subscriptions import Subscriptions
from shared import schema
from shared.errors import error_from_code
from shared.redis_refusal import BROKER_FAULTS, broker_unavailable, reason_of
from shared.schema import TaskEnvelope
from shared.tensor_wire import SHM, iter_wires

if TYPE_CHECKING:
    from collections.abc import Iterator

    from celery import Celery

__all__ = ["AsyncResultHandle", "Event", "broker_faults"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Event:
    """A change of a request's state.

    Attributes:
        id: the request's task id.
        state: ``PROGRESS`` while a worker reports progress (a video's frames), then the final
            state: ``SUCCESS``, ``FAILURE`` or ``REVOKED``.
        progress: ``{"done": n, "total": m}`` with ``PROGRESS``, else ``None``.
        outcome: with a final state, ``{"result": ...}`` or ``{"error": {"code", "message",
            "type"}}`` (as ``FleetClient``'s ``wait_all`` and ``ResultHandle.outcome``
            give it; tensors resolved), else ``None``.
    """

    id: str
    state: str
    progress: dict[str, Any] | None = None
    outcome: dict[str, Any] | None = None

    @property
    def final(self) -> bool:
        """Whether this is the request's last event (its outcome)."""
        return self.outcome is not None


class Client(Protocol):
    """What an :class:`AsyncResultHandle` needs of the ``AsyncFleetClient`` that made it."""

    app: Celery
    redis: Any
    subscriptions: Subscriptions

    def release_inputs(self, inputs: Any) -> int: ...
    def resolve(self, result: Any, release: bool = True) -> Any: ...


@contextlib.contextmanager
def broker_faults(doing: str) -> Iterator[None]:
    """Redis' refusals, refused credentials, an address that is not Redis and lost
    connections inside the block as ``BrokerUnavailable``
    (``<doing>: <the reason in words>``); other errors as they are. Wrap Redis calls only: a
    wait's ``TimeoutError`` is an ``OSError`` too."""
    try:
        yield
    except BROKER_FAULTS as exc:
        if reason_of(exc) is None:
            raise
        raise broker_unavailable(exc, doing) from exc


class AsyncResultHandle:
    """A request submitted by ``AsyncFleetClient``: its task ``id`` and ways to await its
    outcome (:meth:`result`, :meth:`outcome`) or follow it (:meth:`events`)."""

    def __init__(self, client: Client, task_id: str, envelope: TaskEnvelope) -> None:
        self.client = client
        self.id = task_id
        self.envelope = envelope
        self._final: Event | None = None  # kept: its tensors are mapped and released once
        self._settling = asyncio.Lock()  # two waiters on one handle settle it once

    def __repr__(self) -> str:
        return f"AsyncResultHandle(id={self.id!r}, modality={self.envelope.modality!r})"

    async def result(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """The request's result, once it is final.

        Raises:
            FleetError: the request failed; the subclass and ``.code`` are the worker's.
            TimeoutError: no final outcome within ``timeout_s``.
            BrokerUnavailable: Redis refused the subscription or the read, or was not reached.
        """
        out = await self.outcome(timeout_s)
        if "error" in out:
            raise error_from_code(out["error"]["code"], out["error"]["message"])
        return out["result"]

    async def outcome(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """``{"result": ...}`` or ``{"error": {"code", "message", "type"}}``, once final.

        Raises:
            TimeoutError, BrokerUnavailable: as :meth:`result`.
        """
        async with contextlib.aclosing(self.events(timeout_s)) as events:
            async for event in events:
                if event.outcome is not None:
                    return event.outcome
        raise AssertionError("events() ends with a final event or raises")  # pragma: no cover

    async def events(self, timeout_s: float | None = None) -> AsyncIterator[Event]:
        """The request's events as they happen: its stored state first (when a worker
        stored one), then each ``PROGRESS`` a worker publishes (``{"done", "total"}``
        frames of a video, at most four a second), then the final one; the same state twice
        in a row is given once. Ends after the final event. Nothing polls: the request's
        result channel is subscribed, and the stored document read once the subscription is
        confirmed. Leave early with ``contextlib.aclosing`` (else the subscription lasts
        until the generator is collected).

        Raises:
            TimeoutError: no final event within ``timeout_s`` (``None``: no limit).
            BrokerUnavailable: as :meth:`result`.
        """
        if self._final is not None:
            yield self._final
            return
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        name = schema.result_key(self.id)
        with broker_faults(f"could not wait for {self.id}"):
            listening = await self.client.subscriptions.join(name)
        try:
            await self._within(listening.ready(), deadline, timeout_s)
            with broker_faults(f"could not read the result of {self.id}"):
                raw = await self.client.redis.get(name)
            last: Event | None = None
            while True:
                event = None if raw is None else await self._event(raw)
                if event is not None and event != last:
                    last = event
                    yield event
                    if event.final:
                        return
                raw = await self._within(listening.next(), deadline, timeout_s)
        finally:  # shielded: a cancelled consumer (a closed HTTP stream) still unsubscribes
            await asyncio.shield(self.client.subscriptions.leave(listening))

    async def state(self) -> str:
        """The request's state now: ``PENDING`` (no document stored: queued, or unknown),
        ``PROGRESS``, ``SUCCESS``, ``FAILURE`` or ``REVOKED``.

        Raises:
            BrokerUnavailable: as :meth:`result`.
        """
        with broker_faults(f"could not read the state of {self.id}"):
            raw = await self.client.redis.get(schema.result_key(self.id))
        if raw is None:
            return "PENDING"
        return str(schema.decode_result(self.client.app.backend, raw).get("status", "PENDING"))

    async def _within(self, waiting: Awaitable[T], deadline: float | None, timeout_s: Any) -> T:
        """``waiting``'s value, or ``TimeoutError`` at ``deadline`` (the loop's clock)."""
        if deadline is None:
            return await waiting
        left = max(deadline - asyncio.get_running_loop().time(), 0.0)
        try:
            return await asyncio.wait_for(waiting, left)
        except TimeoutError:
            raise TimeoutError(f"no result for {self.id} within {timeout_s} s") from None

    async def _event(self, raw: bytes | str) -> Event | None:
        """The event a stored or published document stands for (``None``: a state that is
        neither progress nor final, e.g. Celery's ``STARTED``). A final one is settled
        once: the request's inputs released, its result's tensors resolved."""
        meta = schema.decode_result(self.client.app.backend, raw)
        status = str(meta.get("status"))
        if status == "PROGRESS":
            progress = meta.get("result")
            return Event(self.id, status, progress if isinstance(progress, dict) else None)
        if status not in READY_STATES:
            return None
        async with self._settling:
            if self._final is None:
                outcome = outcome_from_meta(meta)
                if any(True for _ in iter_wires(self.envelope.inputs, SHM)):
                    await asyncio.to_thread(self.client.release_inputs, self.envelope.inputs)
                if "result" in outcome and any(True for _ in iter_wires(outcome["result"])):
                    resolved = await asyncio.to_thread(self.client.resolve, outcome["result"])
                    outcome = {"result": resolved}
                self._final = Event(self.id, status, None, outcome)
            return self._final

"""Admission: a received request becomes a pending request for the batcher, or a coded
refusal that fails it alone, at once.

Two steps, both on the worker's event-loop thread:

1. :func:`screen` (cheap, before Redis is asked anything): positional arguments, the
   envelope's schema, its priority, the modality and model this worker serves, the deadline.
2. :meth:`Admission.admit` (after its arrival was recorded and its deaths counted,
   ``workers.batching.execution``): refuse a poison message, strip an injected fault, renew
   its /dev/shm inputs, ``prepare`` them, and build the
   :class:`~workers.batching.batcher.Pending` (a suspect in a bucket of its own).

No Celery here: a request is any object with an ``id``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shared.errors import DeadlineExceeded, FleetError, InvalidInput, UnsupportedModality
from shared.schema import Priority, TaskEnvelope
from shared.tracing import Tracing
from workers.batching.batcher import Pending, Work
from workers.batching.execution import Deliveries
from workers.batching.inject import RequestInjector
from workers.batching.tensor_lease import renew_inputs
from workers.models.base import ModelAdapter

__all__ = ["Admission", "Refusal", "Served", "screen"]

log = logging.getLogger("fleet.engine")


@dataclass(frozen=True, slots=True)
class Served:
    """What this worker serves: one modality, one model (by its configured name)."""

    modality: str
    model: str

    def check(self, env: TaskEnvelope) -> None:
        """Refuse an envelope for another modality, or naming a model this worker lacks.

        Raises:
            UnsupportedModality: ``env.modality`` is not this worker's.
            InvalidInput: ``env.model`` is set and is not the configured model's name.
        """
        if env.modality != self.modality:
            raise UnsupportedModality(
                f"modality {env.modality!r} sent to the {self.modality!r} queue"
            )
        if env.model is not None and env.model != self.model:
            raise InvalidInput(
                f"model {env.model!r} is not served; {self.modality} workers serve "
                f"{self.model!r} (or leave 'model' null)"
            )


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request failed at admission: its coded error and its priority's metric label
    (``"unknown"`` until the priority parsed)."""

    error: FleetError
    priority: str = "unknown"


def screen(args: Any, kwargs: Any, served: Served) -> TaskEnvelope | Refusal:
    """The envelope of a task called with ``args``/``kwargs``, or why it is refused."""
    label = "unknown"
    try:
        if args:
            raise InvalidInput(
                "positional task arguments are not accepted; the envelope travels as "
                "the keyword argument 'request'"
            )
        env = TaskEnvelope.from_kwargs(kwargs)
        # Only the four classes become metric labels: a producer sending arbitrary
        # priority strings must not create unbounded Prometheus series.
        Priority.parse(env.priority)
        label = env.priority
        served.check(env)
        if env.expired():  # waited in Redis past its deadline: do not even validate it
            raise DeadlineExceeded("deadline passed before it could run")
    except FleetError as exc:
        return Refusal(exc, label)
    return env


class Admission:
    """Decode screened requests into pending ones.

    Args:
        adapter: the model adapter (``prepare`` is called here).
        deliveries: poison accounting (refusal and suspect buckets).
        faults: the request injector (strips ``_inject`` when injection is on).
        tracing: the engine's tracing hooks.
        store: returns the worker's /dev/shm store (called only for inputs with refs).
        clock: monotonic seconds; a request arrives once it is prepared.
    """

    def __init__(
        self,
        adapter: ModelAdapter,
        deliveries: Deliveries,
        faults: RequestInjector,
        tracing: Tracing,
        store: Callable[[], Any],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.adapter, self.deliveries, self.faults = adapter, deliveries, faults
        self.tracing, self.store, self.clock = tracing, store, clock

    def admit(
        self, req: Any, env: TaskEnvelope, count: int, twins: list[Any] | None = None
    ) -> Pending | FleetError:
        """``req`` as a pending request (its :class:`Work` in ``item``), or its error.

        Args:
            count: its deliveries with its worker's death so far, this one included
                (1 + deaths; 0: not known).
            twins: more copies of its task id, already held with it.
        """
        try:
            refusal = self.deliveries.refusal(req.id, count)
            if refusal is not None:
                raise refusal
            inputs, fault = env.inputs, None
            if self.faults.enabled:
                inputs, fault = self.faults.split(inputs)
            # Its /dev/shm inputs live while it may run: renewed before prepare maps them.
            if self.adapter.tensor_inputs:
                renew_inputs(self.store, inputs, req.id)
            if fault is not None:
                self.faults.on_prepare(fault)
            with self.tracing.in_request(req):
                prepared = self.adapter.prepare(inputs)
        except Exception as exc:  # an adapter bug must not kill the consumer either
            if isinstance(exc, FleetError):
                return exc
            log.exception("prepare failed id=%s", req.id)
            return InvalidInput(f"input could not be prepared: {exc}")
        now = self.clock()
        work = Work(req, env, prepared, now, fault=fault, twins=[] if twins is None else twins)
        work.suspect = self.deliveries.suspect(count)
        return work.pending(now, self.deliveries.bucket(prepared.bucket, req.id, count))

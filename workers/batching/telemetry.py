"""The engine's tracing hooks (see ``shared.tracing``): no-ops unless tracing is on.

One :class:`Tracing` per engine. A request's ``fleet.request`` span starts when its message
enters the prefetch window (parent: the producer's ``traceparent`` header) and ends with its
final outcome; a batch's ``fleet.batch`` span is a child of its first member's request span
(so a request's trace holds the batch it ran in) and links every member's; ``model.forward``,
``shm.get``/``shm.put`` and ``result.write`` are children of the batch (``shm.get`` while a
request's input is decoded at arrival: a child of that request's span).

Thread safety: spans are kept in dicts keyed by task id, touched under the GIL by the loop
thread (arrival, finish) and the inference threads (batches); each operation is one dict
access.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from shared import tracing
from shared.settings import Settings


class Tracing:
    """Spans of one worker's requests and batches.

    Args:
        settings: ``[tracing]`` decides whether anything is recorded.
        modality: the worker's modality (``service.name`` is ``fleet-worker-<modality>``).
    """

    def __init__(self, settings: Settings, modality: str) -> None:
        self.on = tracing.configure(settings, f"fleet-worker-{modality}") is not None
        self.modality = modality
        self._requests: dict[str, Any] = {}  # task id -> its fleet.request span
        self._batch_of: dict[str, Any] = {}  # task id -> context of the batch it ran in
        if self.on:
            from opentelemetry import context, propagate, trace
            from opentelemetry.trace import Link, SpanKind

            self._trace, self._context, self._propagate = trace, context, propagate
            self._Link, self._SpanKind = Link, SpanKind
            self._tracer = tracing.tracer("mmfleet.worker")

    # -- requests ------------------------------------------------------------------------
    def arrived(self, req: Any) -> None:
        """Start ``req``'s span; its parent is the ``traceparent`` header, if any."""
        if not self.on or req.id in self._requests:
            return
        headers = getattr(req, "request_dict", None) or {}
        parent = self._propagate.extract({k: v for k, v in headers.items() if k == "traceparent"})
        info = getattr(req, "delivery_info", None) or {}
        self._requests[req.id] = self._tracer.start_span(
            "fleet.request",
            context=parent,
            kind=self._SpanKind.CONSUMER,
            attributes={
                "fleet.modality": self.modality,
                "messaging.message.id": req.id,
                "messaging.destination.name": str(info.get("routing_key", "")),
            },
        )

    @contextlib.contextmanager
    def in_request(self, req: Any) -> Iterator[None]:
        """Make ``req``'s span current (its input's ``shm.get`` becomes a child)."""
        span = self._requests.get(req.id) if self.on else None
        if span is None:
            yield
            return
        with self._trace.use_span(span, end_on_exit=False):
            yield

    def finished(self, req: Any, code: str | None, outcome: str = "ok") -> None:
        """End ``req``'s span with its outcome (``code``: an error code, None = success;
        ``outcome``: what to record without a code, e.g. ``given_back``)."""
        if not self.on:
            return
        self._batch_of.pop(req.id, None)
        span = self._requests.pop(req.id, None)
        if span is None:
            return
        span.set_attribute("fleet.outcome", code or outcome)
        if code is not None:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, code))
        span.end()

    # -- batches -------------------------------------------------------------------------
    @contextlib.contextmanager
    def batch(self, reqs: Sequence[Any]) -> Iterator[None]:
        """A ``fleet.batch`` span, current for the block (on the inference thread)."""
        if not self.on or not reqs:
            yield
            return
        members = [self._requests.get(r.id) for r in reqs]
        links = [self._Link(s.get_span_context()) for s in members if s is not None]
        first = members[0]
        parent = self._trace.set_span_in_context(first) if first is not None else None
        with self._tracer.start_as_current_span(
            "fleet.batch",
            context=parent,
            links=links,
            attributes={"fleet.modality": self.modality, "fleet.batch_size": len(reqs)},
        ):
            ctx = self._context.get_current()
            for r in reqs:
                self._batch_of[r.id] = ctx
            yield

    @contextlib.contextmanager
    def span(self, name: str, **attributes: Any) -> Iterator[None]:
        """A child of the current span (``model.forward``, ``shm.put``...)."""
        if not self.on:
            yield
            return
        with self._tracer.start_as_current_span(name, attributes=attributes):
            yield

    @contextlib.contextmanager
    def result_write(self, reqs: Sequence[Any]) -> Iterator[None]:
        """``result.write`` of ``reqs``, a child of the first one's batch (loop thread)."""
        ctx = self._batch_of.get(reqs[0].id) if self.on and reqs else None
        if ctx is None:
            yield
            return
        with self._tracer.start_as_current_span(
            "result.write", context=ctx, attributes={"fleet.results": len(reqs)}
        ):
            yield

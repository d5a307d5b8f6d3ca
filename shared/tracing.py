"""OpenTelemetry tracing of the fleet: off by default, on with one setting.

``[tracing] otlp_endpoint = "http://collector:4318/v1/traces"`` (OTLP over HTTP; Jaeger and
the OpenTelemetry Collector accept it) or ``[tracing] file = "/path/spans.jsonl"`` (one JSON
span per line, for tests and offline reading) turns it on in every process that reads the
settings; ``sample_ratio`` (default 1.0) samples traces at their root, and a request carries
its producer's decision to the worker (parent-based sampling).

Spans: the producer's ``fleet.submit`` (kind PRODUCER) around the publish, whose context
travels as the W3C ``traceparent`` message header (producers in other languages set the same
header: ``00-<32 hex trace id>-<16 hex span id>-<2 hex flags>``); on the worker, one
``fleet.request`` (CONSUMER, child of ``fleet.submit``) from the window arrival to the
final outcome; one ``fleet.batch`` per batch, child of its first member's request span and
linked to every member's; under it ``model.forward``, ``shm.get`` / ``shm.put`` and
``result.write``.

With tracing off nothing here imports OpenTelemetry and every hook is one attribute test.


The worker's side: one :class:`Tracing` per engine, its hooks no-ops unless tracing is on. A
request's ``fleet.request`` span starts when its message enters the prefetch window (parent: the
producer's ``traceparent`` header) and ends with its final outcome; a batch's ``fleet.batch`` span
is a child of its first member's request span (so a request's trace holds the batch it ran in) and
links every member's; ``model.forward``, ``shm.get``/``shm.put`` and ``result.write`` are children
of the batch (``shm.get`` while a request's input is decoded at arrival: a child of that request's
span).

Thread safety: spans are kept in dicts keyed by task id, touched under the GIL by the loop
thread (arrival, finish) and the inference threads (batches); each operation is one dict
access.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, MutableMapping, Sequence
from pathlib import Path
from typing import Any

from shared.settings import Settings

__all__ = [
    "TRACEPARENT",
    "Tracing",
    "active",
    "configure",
    "enabled",
    "inject",
    "producer_span",
    "reset",
    "shutdown",
    "span",
    "tracer",
]


log = logging.getLogger("fleet.tracing")


TRACEPARENT = "traceparent"

_NO_SPAN = contextlib.nullcontext()  # in_request with tracing off (reentrant, reusable)


_lock = threading.Lock()


_provider: Any = None  # this process's TracerProvider, once configured


def enabled(settings: Settings) -> bool:
    t = settings.tracing
    return bool(t.otlp_endpoint or t.file)


class _FileExporter:
    """A SpanExporter writing one JSON object per span and line (append, flushed per batch)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()

    def export(self, spans: Any) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        lines = "".join(s.to_json(indent=None) + "\n" for s in spans)  # one line each
        with self._lock, self.path.open("a") as f:
            f.write(lines)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def configure(settings: Settings, service: str, exporter: Any = None) -> Any:
    """This process's tracer provider (once per process; later calls return it).

    Args:
        service: the ``service.name`` resource (``fleet-producer``, ``fleet-worker-text``).
        exporter: a SpanExporter to use instead of the settings' (tests: the SDK's
            ``InMemorySpanExporter``, exported synchronously).

    Returns:
        The provider, or ``None`` when tracing is off and no exporter is given.
    """
    global _provider
    with _lock:
        if _provider is not None:
            return _provider
        if exporter is None and not enabled(settings):
            return None
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        t = settings.tracing
        provider = TracerProvider(
            resource=Resource.create({"service.name": service}),
            sampler=ParentBased(TraceIdRatioBased(t.sample_ratio)),
        )
        if exporter is not None:
            provider.add_span_processor(SimpleSpanProcessor(exporter))
        else:
            if t.otlp_endpoint:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter,
                )

                provider.add_span_processor(
                    BatchSpanProcessor(OTLPSpanExporter(endpoint=t.otlp_endpoint))
                )
            if t.file:
                provider.add_span_processor(
                    BatchSpanProcessor(_FileExporter(Path(t.file)), schedule_delay_millis=500)
                )
        # Not made OpenTelemetry's global provider: the fleet's spans come from this one,
        # and a host application's own setup stays its own.
        _provider = provider
        return provider


def tracer(name: str = "mmfleet") -> Any:
    """A tracer of this process's provider (call :func:`configure` first)."""
    if _provider is None:
        raise RuntimeError("tracing is not configured in this process")
    return _provider.get_tracer(name)


def reset() -> None:
    """Shut down and forget this process's provider (tests that configure their own)."""
    global _provider
    with _lock:
        if _provider is not None:
            _provider.shutdown()
        _provider = None


def active() -> bool:
    """Whether this process traces (``configure`` made a provider)."""
    return _provider is not None


def inject(headers: MutableMapping[str, Any], modality: str, task_id: str) -> None:
    """A ``fleet.submit`` span for a message published later (the gateway's raw push): its
    context goes into ``headers``. A no-op when this process has no provider."""
    if _provider is None:  # the common case, per message: no context manager to enter
        return
    with producer_span(headers, modality, task_id):
        pass


def span(name: str, **attributes: Any) -> contextlib.AbstractContextManager[Any]:
    """A child of the current span (a worker's ``shm.get``/``shm.put`` inside its batch's or
    request's span). A no-op when this process has no provider."""
    if _provider is None:
        return contextlib.nullcontext()
    return tracer("mmfleet.worker").start_as_current_span(name, attributes=attributes)


def shutdown() -> None:
    """Flush and stop this process's exporters (a worker's shutdown)."""
    if _provider is not None:
        _provider.shutdown()


@contextlib.contextmanager
def producer_span(headers: MutableMapping[str, Any], modality: str, task_id: str) -> Iterator[None]:
    """Around one publish: a ``fleet.submit`` span whose context goes into ``headers`` as
    ``traceparent``. A no-op when this process has no provider."""
    if _provider is None:
        yield
        return
    from opentelemetry.propagate import inject
    from opentelemetry.trace import SpanKind

    with tracer().start_as_current_span(
        "fleet.submit",
        kind=SpanKind.PRODUCER,
        attributes={"fleet.modality": modality, "messaging.message.id": task_id},
    ):
        inject(headers)
        yield


class Tracing:
    """Spans of one worker's requests and batches.

    Args:
        settings: ``[tracing]`` decides whether anything is recorded.
        modality: the worker's modality (``service.name`` is ``fleet-worker-<modality>``).
    """

    def __init__(self, settings: Settings, modality: str) -> None:
        self.on = configure(settings, f"fleet-worker-{modality}") is not None
        self.modality = modality
        self._requests: dict[str, Any] = {}  # task id -> its fleet.request span
        self._batch_of: dict[str, Any] = {}  # task id -> context of the batch it ran in
        if self.on:
            from opentelemetry import context, propagate, trace
            from opentelemetry.trace import Link, SpanKind

            self._trace, self._context, self._propagate = trace, context, propagate
            self._Link, self._SpanKind = Link, SpanKind
            self._tracer = tracer("mmfleet.worker")

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

    def in_request(self, req: Any) -> contextlib.AbstractContextManager[Any]:
        """Make ``req``'s span current (its input's ``shm.get`` becomes a child); with
        tracing off, a context that does nothing (shared: no generator per request)."""
        span = self._requests.get(req.id) if self.on else None
        if span is None:
            return _NO_SPAN
        return self._trace.use_span(span, end_on_exit=False)

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

"""The ``celery-batches`` peer: a Celery worker whose task is a ``celery_batches.Batches``.

What a Celery user who wants batching picks instead of this product: the same queue, the
same messages and the same model code (:class:`~producer.tools.bench.peers.model.BatchModel`),
batched by celery-batches (``flush_every`` = the fleet's ``max_batch_size``,
``flush_interval`` = its ``max_queue_delay_ms``), the same prefetch window
(``--prefetch-multiplier`` = the fleet's ``prefetch_multiplier``), one thread pool slot.
Results are stored with ``backend.mark_as_done`` / ``mark_as_failure``, as celery-batches
documents, so the bench collects them from Redis like the fleet's.

Started by the bench in the peer venv (celery-batches pins ``celery<5.7``)::

    FLEET_WORKER_MODALITY=text .venv-peers/bin/python -m celery \
        -A producer.tools.bench.peers.batches_app worker -Q text -P threads -c 1 ...
"""

from __future__ import annotations

import logging
import os
from typing import Any

from celery import signals
from celery_batches import Batches

from shared.celery_app import make_app
from shared.schema import task_name
from shared.settings import MODALITIES, load_settings

log = logging.getLogger("fleet.bench.peer")

MODALITY = os.environ.get("FLEET_WORKER_MODALITY", "text")
if MODALITY not in MODALITIES:
    raise SystemExit(f"FLEET_WORKER_MODALITY must be one of {MODALITIES}, not {MODALITY!r}")

settings = load_settings()
app = make_app(settings, name="bench-celery-batches", role="worker")
_batching = settings.modality(MODALITY).batching
_model: Any = None


@app.task(
    base=Batches,
    name=task_name(MODALITY),
    flush_every=_batching.max_batch_size,
    flush_interval=max(_batching.max_queue_delay_ms, 1.0) / 1000.0,
    acks_late=True,
)
def infer(requests: list[Any]) -> None:
    """One celery-batches flush: run the buffered requests as one batch, store each result."""
    envelopes = [r.kwargs.get("request") for r in requests]
    for req, outcome in zip(requests, _model.run(envelopes), strict=True):
        if outcome.error is not None:
            # celery-batches' SimpleRequest has no ``errbacks``: Celery's default
            # call_errbacks=True raises on it and the flush loses the rest of its batch.
            app.backend.mark_as_failure(req.id, outcome.error, request=req, call_errbacks=False)
        else:
            app.backend.mark_as_done(req.id, outcome.result, request=req)


@signals.worker_init.connect
def _load(sender: Any = None, **_: Any) -> None:
    # Loaded before the consumer starts, as the fleet's worker does: a ping means ready.
    global _model
    from producer.tools.bench.peers.model import BatchModel

    _model = BatchModel(MODALITY)
    log.info("celery-batches peer ready modality=%s load_s=%.2f", MODALITY, _model.load_s)

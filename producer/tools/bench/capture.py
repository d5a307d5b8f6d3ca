"""The exact messages a producer sends: what ``submit_many`` pushes for a list of requests,
captured byte for byte, for the paths that replay them without the client (the submit-rate
workload's ``raw`` path, the ``redis-limit`` mode)."""

from __future__ import annotations

from typing import Any

from producer.client import FleetClient, SubmitRequest
from producer.tools.bench.results import BenchError
from shared import schema
from shared.settings import PRIORITY_NAMES

CHUNK = 100  # requests per submit_many call and LPUSHes per raw pipeline

Message = tuple[str, bytes]  # (priority list key, raw kombu message)


def list_keys(modalities: list[str]) -> list[str]:
    """Every priority list a request of these modalities can be pushed to."""
    queues = sorted({schema.queue_for(m, p) for m in modalities for p in PRIORITY_NAMES})
    return [schema.priority_list_key(q, step) for q in queues for step in schema.PRIORITY_STEPS]


def capture_messages(
    client: FleetClient, admin: Any, requests: list[SubmitRequest], keys: list[str]
) -> list[Message]:
    """The exact messages ``submit_many`` pushes for ``requests``: sent in chunks of
    ``CHUNK``, read back from the priority lists ``keys`` (``LRANGE``), the lists then
    deleted.

    Raises:
        BenchError: the lists do not hold exactly ``len(requests)`` messages.
    """
    for i in range(0, len(requests), CHUNK):
        client.submit_many(requests[i : i + CHUNK])
    messages = [(k, m) for k in keys for m in admin.lrange(k, 0, -1)]
    admin.delete(*keys)
    if len(messages) != len(requests):
        raise BenchError(f"the capture pass enqueued {len(messages)} of {len(requests)} messages")
    return messages

"""The Python client a backend service imports: ``from producer.client import FleetClient``.

Everything a producer needs, and nothing else: this package imports no other producer folder
(the gateway, CLI, stack, ops and tools build on it; ``tests/unit/test_import_graph.py``).

    fleet.py     FleetClient and SubmitRequest: validate, route and publish requests (queue
                 depth judged first); the image, video and cross-modal input builders
    wire.py      the bytes of one request on Redis (kombu's message, built without kombu) and
                 how chunks of them go onto Redis (one transaction, refusals coded)
    results.py   ResultHandle and reading many results: poll, wait_all, cancel; tensor wire
                 objects in a result resolved to arrays
"""

from producer.client.fleet import (
    VIDEO_INLINE_MAX_BYTES,
    FleetClient,
    SubmitRequest,
    image_inputs,
    video_inputs,
    xmodal_inputs,
)
from producer.client.results import (
    READY_STATES,
    ResultHandle,
    outcome_from_meta,
    resolve_tensors,
    tensor_wires,
)

__all__ = [
    "READY_STATES",
    "VIDEO_INLINE_MAX_BYTES",
    "FleetClient",
    "ResultHandle",
    "SubmitRequest",
    "image_inputs",
    "outcome_from_meta",
    "resolve_tensors",
    "tensor_wires",
    "video_inputs",
    "xmodal_inputs",
]

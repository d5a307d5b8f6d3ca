"""The Python client a backend service imports: ``from producer.client import FleetClient``.

Everything a producer needs, and nothing else: this package imports no other producer folder
(the gateway, CLI, stack, ops and tools build on it; ``tests/unit/test_import_graph.py``).

    fleet.py     FleetClient and SubmitRequest: validate, build and submit requests
    publish.py   the broker side of FleetClient: publish, queue state (composed in)
    push.py      how chunks of messages go onto Redis (one transaction, refusals coded)
    wire.py      the bytes of one request on Redis (kombu's message, built without kombu)
    results.py   ResultHandle and reading many results: poll, wait_all, cancel
    inputs.py    image, video and cross-modal inputs; tensor wire objects to arrays
"""

from producer.client.fleet import FleetClient, SubmitRequest
from producer.client.inputs import (
    VIDEO_INLINE_MAX_BYTES,
    image_inputs,
    resolve_tensors,
    tensor_wires,
    video_inputs,
    xmodal_inputs,
)
from producer.client.results import READY_STATES, ResultHandle, outcome_from_meta

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

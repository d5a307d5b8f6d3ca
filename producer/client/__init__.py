"""The Python clients a backend service imports: ``from producer.client import FleetClient``
(blocking calls) or ``AsyncFleetClient`` (asyncio).

Everything a producer needs, and nothing else: this package imports no other producer folder
(the gateway, CLI, stack, ops and tools build on it; ``tests/unit/test_import_graph.py``).

    fleet.py            FleetClient, SubmitRequest and ClientBase (what both clients share
                        without I/O: validation, task ids, the messages, the /dev/shm store);
                        the blocking publish (queue depth judged first); the image, video and
                        cross-modal input builders
    wire.py             the bytes of one request on Redis (kombu's message, built without
                        kombu), the commands that push a chunk of them, and how FleetClient
                        sends those (one transaction, refusals coded)
    results.py          ResultHandle and reading many results: poll, wait_all, cancel (its
                        Revocation, shared with the asyncio client); tensor wire objects in a
                        result resolved to arrays
    asyncio_client.py   AsyncFleetClient: the same requests and errors on redis.asyncio
    asyncio_results.py  AsyncResultHandle and its Events: result, outcome, progress
    subscriptions.py    the asyncio client's one pubsub connection for result notifications
"""

from producer.client.asyncio_client import AsyncFleetClient
from producer.client.asyncio_results import AsyncResultHandle, Event
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
    "AsyncFleetClient",
    "AsyncResultHandle",
    "Event",
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

"""The HTTP gateway: Open Inference Protocol v2 REST (and Triton's binary-data extension)
over the fleet, for clients that do not speak Celery.

Modules, one job each: :mod:`~producer.gateway.app` (routes), :mod:`~producer.gateway.codec`
(OIP tensors, binary extension), :mod:`~producer.gateway.models` (served models, inputs and
outputs), :mod:`~producer.gateway.params` (priority, timeout, Prefer, ids),
:mod:`~producer.gateway.jobs` (submit, idempotency, state, cancel),
:mod:`~producer.gateway.waiter` (results over pubsub), :mod:`~producer.gateway.admission`
(QUEUE_FULL, DEADLINE_UNREACHABLE), :mod:`~producer.gateway.auth` (bearer token),
:mod:`~producer.gateway.render` (responses), :mod:`~producer.gateway.errors` (codes ->
statuses), :mod:`~producer.gateway.server` (uvicorn). A producer: never imports torch.
"""

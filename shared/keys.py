"""Every Celery name and Redis key the product uses, in one place.

Queues: one per modality, named after it (``text``, ``image``, ``video``, ``xmodal``), and one
for its REALTIME requests (``text.realtime``, ...).
Celery's Redis transport stores each priority step of a queue in its own list: the step-0
list is the queue name itself, step ``p`` is ``f"{queue}{PRIORITY_SEP}{p}"``.
"""

from __future__ import annotations

__all__ = [
    "DELIVERY_COUNT_PREFIX",
    "FINAL_KEY_PREFIX",
    "JOB_KEY_PREFIX",
    "LIVE_FORGET_S",
    "LIVE_PREFIX",
    "NOTIFY_PROBE_PREFIX",
    "PRIORITY_SEP",
    "PRIORITY_STEPS",
    "RESULT_KEY_PREFIX",
    "TASK_PREFIX",
    "UNACKED_INDEX_KEY",
    "UNACKED_KEY",
    "delivery_count_key",
    "final_key",
    "job_key",
    "live_key",
    "priority_list_key",
    "queue_for",
    "queue_name",
    "realtime_queue_name",
    "result_key",
    "task_name",
]

PRIORITY_STEPS: list[int] = list(range(10))
PRIORITY_SEP = "\x06\x16"  # kombu's default separator; kept so plain Celery clients interoperate

TASK_PREFIX = "fleet."
DELIVERY_COUNT_PREFIX = "fleet:deliveries:"  # INCR per delivery, for poison-message detection
RESULT_KEY_PREFIX = "celery-task-meta-"  # Celery's Redis result backend key
FINAL_KEY_PREFIX = "fleet:final:"  # SET NX by the first final result: later ones are dropped
# kombu's Redis transport: the unacked hash (tag -> [payload, exchange, routing_key]), its
# index (tag scored by delivery or, with leases, last renewal time) and the restore mutex.
UNACKED_KEY = "unacked"
UNACKED_INDEX_KEY = "unacked_index"
# Sorted set per modality: node name scored by its last heartbeat (unix s), written by each
# batching worker with its lease renewals (workers.consumer.lease); live = younger than lease_s.
LIVE_PREFIX = "fleet:live:"
LIVE_FORGET_S = 3600.0  # members silent this long are dropped from the set
# A worker pushes and deletes such a key once to learn whether Redis sends keyspace
# notifications (workers.consumer.channel), without CONFIG, which its ACL user may not run.
NOTIFY_PROBE_PREFIX = "fleet:notify-probe:"
JOB_KEY_PREFIX = "fleet:job:"  # the gateway's job document, written before it queues a request


def task_name(modality: str) -> str:
    """The Celery task name for a modality: ``fleet.text``."""
    return f"{TASK_PREFIX}{modality}"


def queue_name(modality: str) -> str:
    """The Celery queue of a modality; the same string."""
    return modality


def realtime_queue_name(modality: str) -> str:
    """The queue of a modality's REALTIME requests: ``text.realtime``.

    REALTIME requests travel apart so that a worker can read them on a channel whose
    prefetch window lower-priority messages never fill (see ``workers.consumer.realtime``).
    """
    return f"{modality}.realtime"


def queue_for(modality: str, priority_label: str) -> str:
    """The queue a request of ``priority_label`` (``"realtime"``, ...) is sent to."""
    return realtime_queue_name(modality) if priority_label == "realtime" else queue_name(modality)


def priority_list_key(queue: str, celery_priority: int) -> str:
    """The Redis list that holds ``queue``'s messages at one Celery priority step."""
    return queue if celery_priority == 0 else f"{queue}{PRIORITY_SEP}{celery_priority}"


def delivery_count_key(task_id: str) -> str:
    return f"{DELIVERY_COUNT_PREFIX}{task_id}"


def result_key(task_id: str) -> str:
    return f"{RESULT_KEY_PREFIX}{task_id}"


def live_key(modality: str) -> str:
    """The liveness set of ``modality``'s workers (see ``LIVE_PREFIX``)."""
    return f"{LIVE_PREFIX}{modality}"


def job_key(task_id: str) -> str:
    """The gateway's job document of ``task_id`` (``producer.gateway.jobs``)."""
    return f"{JOB_KEY_PREFIX}{task_id}"


def final_key(task_id: str) -> str:
    """Marks that ``task_id`` has its final result (``workers.batching.completion``: first one
    wins)."""
    return f"{FINAL_KEY_PREFIX}{task_id}"

"""``FrontDoor``: a take's messages reach the strategy's arrival directly, or their callback.

Pure dispatch logic, without servers: the messages are the worker channel's own
(``workers.consumer.channel.Message``, built from the bytes the fleet's producer sends), the
consumer a stand-in that records what Celery's consumer would be asked to do.
"""

from __future__ import annotations

import base64
from typing import Any

import orjson
from celery.exceptions import InvalidTaskError
from kombu.exceptions import DecodeError

from workers.consumer.channel import Message
from workers.consumer.engine import FrontDoor


def _payload(task: str, tag: str) -> dict[str, Any]:
    body = orjson.dumps([[], {"request": {"modality": "text"}}, {}])
    return {
        "body": base64.b64encode(body).decode(),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {"task": task, "id": tag},
        "properties": {
            "delivery_tag": tag,
            "body_encoding": "base64",
            "delivery_info": {"exchange": "", "routing_key": "text"},
        },
    }


class _Consumer:
    """What FrontDoor reads of Celery's consumer; records the calls it gets."""

    def __init__(self, restoring: bool = False) -> None:
        self._maximum_prefetch_restored = not restoring
        self.restart_count = 1 if restoring else 0
        self._new_prefetch_count = 1
        self.max_prefetch_count = 256
        self.soon: list[tuple[Any, tuple[Any, ...]]] = []
        self.invalid: list[tuple[Any, Exception]] = []
        self.decode_errors: list[tuple[Any, Exception]] = []

    def call_soon_ack(self, p: Any, *args: Any) -> None:
        self.soon.append((p, args))

    def on_invalid_task(self, body: Any, message: Any, exc: Exception) -> None:
        self.invalid.append((message, exc))

    def on_decode_error(self, message: Any, exc: Exception) -> None:
        self.decode_errors.append((message, exc))


def test_served_messages_reach_the_arrival_and_others_their_callback() -> None:
    arrived: list[tuple[Any, Any]] = []
    called: list[Any] = []
    door, consumer = FrontDoor(), _Consumer()
    door.serve("fleet.text", lambda m, body, ack, reject: arrived.append((m, body)), consumer)
    ours = [Message(_payload("fleet.text", f"t{i}")) for i in range(3)]
    probe = Message(_payload("fleet.probe", "p"))
    plain = Message(_payload("fleet.text", "raw"))
    plain._decoded_cache = None  # as kombu builds one: its body decoded later, by kombu
    group = [(ours[0], called.append), (probe, called.append), (ours[1], called.append)]
    group += [(plain, called.append), (ours[2], called.append)]
    door.receive(group)
    assert [m for m, _ in arrived] == ours  # in order, body left to the strategy (protocol 2)
    assert all(body is None for _, body in arrived)
    assert called == [probe, plain]


def test_the_ack_given_is_the_consumers_call_soon_ack_of_the_message() -> None:
    acks: list[Any] = []
    door, consumer = FrontDoor(), _Consumer()
    door.serve("fleet.text", lambda m, body, ack, reject: acks.append((m, ack, reject)), consumer)
    m = Message(_payload("fleet.text", "t"))
    door.receive([(m, lambda _: None)])
    [(_, ack, reject)] = acks
    ack("logger", ("errors",))
    reject("logger", ("errors",))
    assert consumer.soon == [
        (m.ack_log_error, ("logger", ("errors",))),
        (m.reject_log_error, ("logger", ("errors",))),
    ]


def test_while_the_prefetch_count_is_restored_every_message_takes_its_callback() -> None:
    arrived: list[Any] = []
    called: list[Any] = []
    door = FrontDoor()
    door.serve("fleet.text", lambda m, *_: arrived.append(m), _Consumer(restoring=True))
    msgs = [Message(_payload("fleet.text", f"t{i}")) for i in range(2)]
    door.receive([(m, called.append) for m in msgs])
    assert arrived == [] and called == msgs


def test_errors_go_where_celerys_on_task_received_sends_them() -> None:
    door, consumer = FrontDoor(), _Consumer()
    errors = iter([InvalidTaskError("bad"), DecodeError("undecodable")])

    def arrive(m: Any, *_: Any) -> None:
        raise next(errors)

    door.serve("fleet.text", arrive, consumer)
    a, b = Message(_payload("fleet.text", "a")), Message(_payload("fleet.text", "b"))
    door.receive([(a, lambda _: None), (b, lambda _: None)])
    assert [m for m, _ in consumer.invalid] == [a]
    assert [m for m, _ in consumer.decode_errors] == [b]

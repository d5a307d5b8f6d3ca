"""``AsyncFleetClient`` against real Redis and workers: the session stack (text and image
workers, ``tests/conftest.py``) plus a video worker started here; the client made from the
stack's URL alone (``from_url``). Submitting one request and many, a video's progress
events over the result channel, cancelling, coded errors; and, on a Redis of its own, the
bytes it pushes are the blocking client's.

Each test runs its own event loop (``asyncio.run``) with a client of its own.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import redis

from producer.client import (
    AsyncFleetClient,
    Event,
    FleetClient,
    SubmitRequest,
    image_inputs,
    xmodal_inputs,
)
from producer.client.fleet import CHUNK
from producer.client.results import Revocation
from producer.client.wire import sent_topics
from shared import schema
from shared.errors import (
    BrokerUnavailable,
    FleetError,
    ImageDecodeError,
    InvalidInput,
    InvalidPriority,
    PayloadTooLarge,
    Revoked,
    UnsupportedModality,
)
from tests.conftest import own_redis

pytestmark = pytest.mark.integration
DATA = Path(__file__).resolve().parents[2] / "data"
NASA = DATA / "videos" / "torchcodec_nasa_13013.mp4"
COFFEE = DATA / "images" / "skimage_coffee.png"
T = TypeVar("T")


@pytest.fixture(scope="module")
def video_stack(stack: Any) -> Iterator[Any]:
    """The session stack with a video worker: 8 fps, at most 32 frames (the NASA clip's
    first 4 s, about 2 s of CPU work in frame mini-batches: progress to follow)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("FLEET_MODELS__VIDEO-EFFICIENTNET-LITE0__SAMPLE_FPS", "8")
    mp.setenv("FLEET_MODELS__VIDEO-EFFICIENTNET-LITE0__MAX_FRAMES", "32")
    try:
        stack.start_worker("video")
        yield stack
    finally:
        stack.stop("worker-video")
        mp.undo()


def url_of(st: Any) -> str:
    return str(st.s.redis_url("producer"))


def run(st: Any, test: Callable[[AsyncFleetClient], Awaitable[T]]) -> T:
    """``test(client)`` on a loop of its own, with a client made from the stack's URL."""

    async def main() -> T:
        async with AsyncFleetClient.from_url(url_of(st)) as client:
            return await test(client)

    return asyncio.run(main())


def test_submit_awaits_text_and_image_results_as_the_blocking_client_reads_them(
    stack: Any, client: FleetClient
) -> None:
    async def test(aio: AsyncFleetClient) -> tuple[Any, ...]:
        text = await aio.submit("text", {"text": "A man is playing a guitar."}, "high", 30)
        image = await aio.submit("image", image_inputs(COFFEE))
        got = await asyncio.gather(text.result(60), image.result(60))
        return text, got, await text.state(), await aio.live_workers("text")

    text, (t, i), state, live = run(stack, test)
    assert len(t["embedding"]) == 384 and abs(np.linalg.norm(t["embedding"]) - 1) < 1e-4
    assert i["dim"] == 1280 and len(i["labels"]) > 0
    assert state == "SUCCESS"
    assert live == client.live_workers("text") and live
    # the blocking client reads the same outcome for the same id
    assert client.poll([text])[0]["result"] == t  # type: ignore[list-item]
    assert text.envelope.priority == "high" and text.envelope.deadline_ms is not None


def test_submit_many_sends_chunks_and_every_result_arrives(stack: Any) -> None:
    n = CHUNK + 7  # two transactions
    prios = ["bulk", "normal", "high", "realtime"]

    async def test(aio: AsyncFleetClient) -> tuple[list[Any], list[Any], float]:
        requests = [
            SubmitRequest("text", {"text": f"sentence {i} about rivers"}, prios[i % 4], 60)
            for i in range(n)
        ]
        started = time.monotonic()
        handles = await aio.submit_many(requests)
        # many waiters on one pubsub connection, subscribed at once
        outcomes = await asyncio.gather(*(h.outcome(90) for h in handles))
        return handles, outcomes, time.monotonic() - started

    handles, outcomes, took = run(stack, test)
    assert len({h.id for h in handles}) == n
    assert [h.envelope.priority for h in handles] == [prios[i % 4] for i in range(n)]
    assert all(len(o["result"]["embedding"]) == 384 for o in outcomes), outcomes[:2]
    assert took < 90


def test_events_follow_a_videos_progress_then_its_result(video_stack: Any) -> None:
    root = video_stack.s.transport.shm_root

    async def test(aio: AsyncFleetClient) -> tuple[list[Event], dict[str, Any], Path]:
        inputs = aio.video_inputs(NASA)  # 657 KB: through /dev/shm
        segment = Path(root) / f"{inputs['video_ref']['id']}.arrow"
        assert segment.exists()
        h = await aio.submit("video", inputs, timeout_s=120)
        events = [e async for e in h.events(timeout_s=120)]
        again = await h.result(1)  # settled once: the same arrays again
        return events, again, segment

    events, again, segment = run(video_stack, test)
    progress = [e for e in events if e.state == "PROGRESS"]
    # published by the worker as it goes (results_write_progress.lua), not polled
    assert len(progress) >= 2, events
    assert all(e.progress is not None and e.progress["total"] == 32 for e in progress)
    done = [e.progress["done"] for e in progress if e.progress is not None]
    assert done == sorted(done) and len(set(done)) == len(done)
    final = events[-1]
    assert final.final and final.state == "SUCCESS" and events.index(final) == len(events) - 1
    assert final.outcome is not None
    result = final.outcome["result"]
    emb = result["frame_embeddings"]
    assert isinstance(emb, np.ndarray) and emb.shape == (32, 1280)
    assert result["frames"] == 32 and result["partial"] is False
    assert again["frame_embeddings"] is emb
    assert not segment.exists()  # the input released once final


def test_workers_publish_progress_on_the_result_channel(video_stack: Any) -> None:
    """What the events above rest on, read with a plain subscriber."""
    client = FleetClient(video_stack.s)
    sub = redis.Redis.from_url(url_of(video_stack)).pubsub()
    try:
        task_id = str(uuid.uuid4())
        inputs = client.video_inputs(NASA, task_id=task_id)
        sub.subscribe(schema.result_key(task_id))
        sub.get_message(timeout=5)  # the confirmation
        client.submit("video", inputs, timeout_s=120, task_id=task_id)
        states = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and "SUCCESS" not in states:
            msg = sub.get_message(timeout=1)
            if msg and msg["type"] == "message":
                states.append(json.loads(msg["data"])["status"])
        assert states.count("PROGRESS") >= 2 and states[-1] == "SUCCESS", states
    finally:
        sub.close()
        client.close()


def test_cancel_revokes_a_queued_request_and_its_waiter_hears_it(stack: Any) -> None:
    """No xmodal worker runs here: the request stays queued until cancelled."""

    async def test(aio: AsyncFleetClient) -> tuple[Any, ...]:
        h = await aio.submit("xmodal", xmodal_inputs(COFFEE, ["a cup of coffee"]), "bulk")
        events = asyncio.create_task(_collect(h.events(timeout_s=30)))
        await asyncio.sleep(0.3)  # the waiter is subscribed and has read nothing final
        assert not events.done()
        cancelled = await aio.cancel(h.id, "not needed any more")
        again = await aio.cancel(h.id)
        seen = await events
        try:
            await h.result(5)
        except FleetError as exc:
            return cancelled, again, seen, exc
        raise AssertionError("a revoked request has no result")

    cancelled, again, seen, exc = run(stack, test)
    assert (cancelled, again) == (True, False)
    assert [e.state for e in seen] == ["REVOKED"]
    assert seen[0].outcome == {
        "error": {"code": "REVOKED", "message": "not needed any more", "type": "Revoked"}
    }
    assert isinstance(exc, Revoked) and exc.code == "REVOKED"


async def _collect(events: Any) -> list[Event]:
    return [e async for e in events]


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (("audio", {"text": "x"}), UnsupportedModality),
        (("text", {"text": "x"}, "urgent"), InvalidPriority),
        (("text", ["not", "an", "object"]), InvalidInput),
        (("text", {"text": "x"}, "normal", -1), InvalidInput),
        (("text", {"text": "x" * 20_001}), PayloadTooLarge),
        (("text", {"text": float("nan")}), InvalidInput),
    ],
    ids=["modality", "priority", "inputs", "timeout", "too-long", "not-json"],
)
def test_bad_input_is_refused_before_sending_with_the_blocking_clients_error(
    stack: Any, client: FleetClient, args: tuple[Any, ...], error: type[FleetError]
) -> None:
    with pytest.raises(error) as blocking:
        client.submit(*args)

    async def test(aio: AsyncFleetClient) -> FleetError:
        depth = await aio.queue_depth("text")
        try:
            await aio.submit(*args)
        except FleetError as exc:
            assert await aio.queue_depth("text") == depth  # nothing sent
            return exc
        raise AssertionError("accepted")

    exc = run(stack, test)
    assert type(exc) is error and exc.code == blocking.value.code
    assert str(exc) == str(blocking.value)


def test_a_request_the_worker_refuses_raises_its_code(stack: Any) -> None:
    async def test(aio: AsyncFleetClient) -> list[Any]:
        bad = base64.b64encode(b"not an image at all").decode()
        handles = [
            await aio.submit("image", {"image_b64": bad}),
            await aio.submit("text", {"text": "   "}),
        ]
        out: list[Any] = []
        for h in handles:
            try:
                await h.result(60)
            except FleetError as exc:
                out.append(exc)
        return out

    image, text = run(stack, test)
    assert isinstance(image, ImageDecodeError) and image.code == "IMAGE_DECODE"
    assert isinstance(text, InvalidInput) and text.code == "INVALID_INPUT"


def test_an_unreachable_redis_is_broker_unavailable(stack: Any) -> None:
    from producer.stack.local import free_port

    url = f"redis://producer:pw@127.0.0.1:{free_port()}/0"

    async def test() -> tuple[BaseException, BaseException, float]:
        async with AsyncFleetClient.from_url(url) as aio:
            started = time.monotonic()
            errors = []
            for call in (aio.submit("text", {"text": "x"}), aio.live_workers("text")):
                try:
                    await call
                except BrokerUnavailable as exc:
                    errors.append(exc)
            return errors[0], errors[1], time.monotonic() - started

    submit, live, took = asyncio.run(test())
    assert isinstance(submit, BrokerUnavailable) and submit.reason == "UNREACHABLE"
    assert isinstance(live, BrokerUnavailable) and live.reason == "UNREACHABLE"
    assert "could not publish" in str(submit)
    assert took < 30


# -- the bytes, against the blocking client's ----------------------------------------------
@pytest.fixture(scope="module")
def bare_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A Redis with no worker: what the clients push stays in its lists."""
    with own_redis(tmp_path_factory, "async-wire-run") as st:
        yield st


class FrozenClock:
    """Redis' clock at one instant: both clients' requests get the same submit time."""

    def __init__(self, now_s: float) -> None:
        self.now_s = now_s

    def now(self) -> float:
        return self.now_s

    def peek(self) -> float:
        return self.now_s

    def due(self) -> bool:
        return False


def _untagged(message: bytes) -> bytes:
    """A message or event group with its delivery tag replaced by a fixed string."""
    tag = json.loads(message)["properties"]["delivery_tag"]
    return message.replace(tag.encode(), b"TAG")


def _events_of(group: bytes) -> list[dict[str, Any]]:
    """The ``task-sent`` events of a group message, less what differs between two sends
    (the Lamport clock, the send time)."""
    events = json.loads(group)["body"]
    for e in events:
        del e["clock"], e["timestamp"]
    return list(events)


def test_the_async_client_pushes_the_blocking_clients_bytes(bare_redis: Any) -> None:
    """The same requests with the same ids through both clients (one Celery app, one
    submit time): the same message bytes, but for the delivery tag; the same
    ``task-sent`` events on the same channel, but for their clock and send time; kombu's
    own channel names that channel too."""
    s = bare_redis.s
    admin = redis.Redis.from_url(s.redis_url("admin"))
    events = admin.pubsub()
    events.psubscribe(f"/{s.redis.db}.celeryev/*")
    events.get_message(timeout=5)
    sync = FleetClient(s)
    sync.clock = FrozenClock(time.time())  # type: ignore[assignment]
    inputs = [
        ("text", {"text": 'h\u00e9 "quoted" \\ \u4e2d \U0001f600'}, "bulk", 5.0),
        ("text", {"text": "x", "n": [1.5, None, True, 10**20, -0.0, 1e-7]}, "realtime", None),
        ("image", {"image_b64": "AAAA"}, "high", None),
    ]
    requests = [SubmitRequest(m, i, p, t, f"id-{n}") for n, (m, i, p, t) in enumerate(inputs)]
    lists = {
        schema.priority_list_key(
            schema.queue_for(m, p), sync.settings.priorities[p].celery_priority
        )
        for m, _, p, _ in inputs
    }

    def pushed() -> list[bytes]:
        out = []
        for key in sorted(lists):
            out += admin.lrange(key, 0, -1)[::-1]  # oldest first
            admin.delete(key)
        return [_untagged(m) for m in out]

    def published() -> tuple[str, list[dict[str, Any]]]:
        msg = None
        while msg is None or msg["type"] != "pmessage":
            msg = events.get_message(timeout=5)
            assert msg is not None, "no task-sent group was published"
        return msg["channel"].decode(), _events_of(msg["data"])

    async def submit_async() -> list[str]:
        aio = AsyncFleetClient(s, app=sync.app)
        aio.clock = sync.clock
        try:
            return [h.id for h in await aio.submit_many(requests)]
        finally:
            await aio.subscriptions.close()
            await aio.redis.aclose(close_connection_pool=True)

    try:
        assert [h.id for h in sync.submit_many(requests)] == [r.task_id for r in requests]
        blocking, blocking_events = pushed(), published()
        assert asyncio.run(submit_async()) == [r.task_id for r in requests]
        asyncio_bytes, asyncio_events = pushed(), published()
        assert len(blocking) == len(inputs) and asyncio_bytes == blocking
        assert asyncio_events == blocking_events
        with sync.app.connection_for_write() as conn:
            kombus = conn.default_channel._get_publish_topics("celeryev", "task.sent")
        assert sent_topics(sync.app, s.redis.db) == kombus == [blocking_events[0]]
    finally:
        events.close()
        sync.close()


def test_cancel_writes_the_blocking_clients_document(bare_redis: Any) -> None:
    s = bare_redis.s
    admin = redis.Redis.from_url(s.redis_url("admin"))
    sync = FleetClient(s)

    async def cancel(task_id: str) -> tuple[bool, bool]:
        async with AsyncFleetClient(s) as aio:
            return await aio.cancel(task_id, "why"), await aio.cancel(task_id, "why")

    try:
        assert sync.cancel("c-sync", "why") is True
        assert asyncio.run(cancel("c-async")) == (True, False)
        docs = [json.loads(admin.get(schema.result_key(t)) or b"{}") for t in ("c-sync", "c-async")]
        for d in docs:
            del d["date_done"], d["task_id"]
        assert docs[0] == docs[1] and docs[0]["status"] == "REVOKED"
        assert admin.get(schema.final_key("c-async")) == b"1"
        ttl = admin.ttl(schema.result_key("c-async"))
        assert 0 < ttl <= s.redis.result_expires_s
    finally:
        sync.close()
        admin.delete(*(schema.result_key(t) for t in ("c-sync", "c-async")))
        admin.delete(*(schema.final_key(t) for t in ("c-sync", "c-async")))


def test_no_fleet_variable_is_needed_beyond_the_url(
    bare_redis: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``FLEET_REDIS_URL`` alone (no other ``FLEET_*``), from a directory with no config."""
    for name in list(os.environ):
        if name.upper().startswith("FLEET_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("FLEET_REDIS_URL", url_of(bare_redis))
    monkeypatch.chdir(tmp_path)

    async def test() -> list[str]:
        async with AsyncFleetClient.from_settings() as aio:
            assert aio.settings.redis.port == bare_redis.s.redis.port
            return await aio.live_workers("text")

    assert asyncio.run(test()) == []  # answered by that Redis (no worker there)


def test_a_final_result_published_while_the_connection_was_away_still_arrives(
    bare_redis: Any,
) -> None:
    """The subscription's connection is killed and the request revoked in one transaction
    (the kill first: the ``PUBLISH`` reaches nobody). redis-py reconnects and subscribes
    again; Redis' confirmation of a channel confirmed before makes the client read the
    stored document once more: the waiter gets the outcome."""
    s = bare_redis.s
    admin = redis.Redis.from_url(s.redis_url("admin"))

    async def test() -> list[Event]:
        async with AsyncFleetClient.from_url(url_of(bare_redis)) as aio:
            h = await aio.submit("xmodal", xmodal_inputs(COFFEE, ["a cup"]), "bulk")
            follow = asyncio.create_task(_collect(h.events(timeout_s=30)))
            await asyncio.sleep(0.3)  # subscribed, nothing stored
            revoking = Revocation.of(aio.app, aio.settings, h.id, "while away")
            with admin.pipeline(transaction=True) as pipe:
                pipe.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
                for command in revoking.commands():
                    pipe.execute_command(*command)
                killed, *_, receivers = pipe.execute()
            assert killed >= 1 and receivers == 0
            return await follow

    try:
        seen = asyncio.run(test())
        assert [e.state for e in seen] == ["REVOKED"]
        assert seen[0].outcome is not None and seen[0].outcome["error"]["code"] == "REVOKED"
    finally:
        for key in admin.keys("xmodal*"):
            admin.delete(key)

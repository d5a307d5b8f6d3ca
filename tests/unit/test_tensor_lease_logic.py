"""The lifetime of request-bound segments (``shared.transport.lifetime``): the pure renewal
decision, then the store and the renewers on real /dev/shm files (no servers; times are
passed in, never waited for)."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import redis
from pydantic import ValidationError

from shared.errors import TensorRefError
from shared.settings import MIN_TTL_JANITOR_INTERVALS, load_settings
from shared.transport import ShmStore, lifetime
from tests.conftest import free_port_block
from workers.batching.tensor_lease import SegmentRenewer, renew_inputs, shm_ref_ids

C, TTL, CAP = 1000.0, 60.0, 600.0  # created_at, ttl_s, max_lifetime_s


@dataclass(frozen=True)
class Seg:
    request: str
    created_at: float
    ttl_s: float
    expires_at: float


def seg(renewed_at: float, request: str = "r1") -> Seg:
    return Seg(request, C, TTL, lifetime.expires_at(C, TTL, renewed_at, CAP, bool(request)))


# -- the pure decision ------------------------------------------------------------------
def test_an_unbound_segment_expires_at_its_ttl_whatever_its_mtime() -> None:
    assert lifetime.expires_at(C, TTL, C + 500, CAP, bound=False) == C + TTL


def test_a_bound_segment_lives_a_ttl_past_its_last_renewal() -> None:
    assert lifetime.expires_at(C, TTL, C, CAP, bound=True) == C + TTL
    assert lifetime.expires_at(C, TTL, C + 100, CAP, bound=True) == C + 100 + TTL
    # an mtime older than its write (a clock step back) never shortens it
    assert lifetime.expires_at(C, TTL, C - 50, CAP, bound=True) == C + TTL


def test_no_renewal_reaches_past_the_cap() -> None:
    assert lifetime.expires_at(C, TTL, C + CAP - 10, CAP, bound=True) == C + CAP
    assert lifetime.expires_at(C, TTL, C + 10 * CAP, CAP, bound=True) == C + CAP  # forged mtime
    # a TTL longer than the cap is the writer's own: the cap only bounds renewals
    assert lifetime.expires_at(C, 2 * CAP, C + CAP, CAP, bound=True) == C + 2 * CAP


def test_renewal_is_due_only_within_the_margin_and_only_if_it_extends() -> None:
    margin = 20.0
    s = seg(renewed_at=C)  # lease ends at C + 60
    assert lifetime.due([s], C + 39, margin, CAP) == []  # 21 s left
    assert lifetime.due([s], C + 41, margin, CAP) == [s]  # 19 s left
    assert lifetime.due([s], C + 90, margin, CAP) == [s]  # lapsed, not collected yet
    unbound = seg(renewed_at=C, request="")
    assert lifetime.due([unbound], C + 59, margin, CAP) == []
    capped = seg(renewed_at=C + CAP - TTL)  # its lease reaches the cap already
    assert capped.expires_at == C + CAP
    assert lifetime.due([capped], C + CAP - 1, margin, CAP) == []
    # near the cap a renewal still extends the lease, up to the cap
    near = seg(renewed_at=C + CAP - TTL - 30)
    assert lifetime.extends(near, C + CAP - TTL - 5, CAP)
    assert lifetime.due([near], C + CAP - 40, margin, CAP) == [near]


def test_only_requests_not_known_final_are_renewed() -> None:
    a, b, c = seg(C, "a"), seg(C, "b"), seg(C, "c")
    # None: Redis could not tell; the request may be queued, so its input is kept
    assert lifetime.still_running([a, b, c], {"a": True, "b": False, "c": None}) == [b, c]


def test_an_operators_collection_renews_only_live_leases_of_requests_known_not_final() -> None:
    margin = 20.0
    a, b, c, d = seg(C, "a"), seg(C, "b"), seg(C, "c"), seg(C, "d")
    final = {"a": True, "b": False, "c": None, "d": False}
    # 19 s left on each: due; only b and d are known not final
    assert lifetime.renewable([a, b, c, d], final, C + 41, margin, CAP) == [b, d]
    # lapsed: never renewed by a collection, whatever Redis says (it goes instead)
    assert lifetime.renewable([a, b, c, d], final, C + TTL, margin, CAP) == []
    assert lifetime.finished(final) == {"a"}


@pytest.mark.parametrize("bad", ["", "-x", "a b", "a/b", "x" * 129, "é"])
def test_a_request_id_is_checked(bad: str) -> None:
    with pytest.raises(ValueError):
        lifetime.validate_request_id(bad)
    assert lifetime.validate_request_id("231d5a94-3930-4485-baca-d590af8aee0c")


def test_the_renewal_margin_fits_inside_the_shortest_ttl_the_settings_allow() -> None:
    assert MIN_TTL_JANITOR_INTERVALS >= lifetime.RENEW_MARGIN_INTERVALS + 1


# -- settings checked at load -----------------------------------------------------------
def test_inconsistent_lifetime_settings_are_refused_at_load() -> None:
    with pytest.raises(ValidationError, match="shorter than 3 janitor intervals"):
        load_settings(transport={"default_ttl_s": 60, "janitor_interval_s": 30})
    with pytest.raises(ValidationError, match="max_ref_lifetime_s = 100 s is shorter"):
        load_settings(transport={"default_ttl_s": 600, "max_ref_lifetime_s": 100})
    with pytest.raises(ValidationError, match="result_expires_s = 300 s is shorter"):
        load_settings(redis={"result_expires_s": 300}, transport={"default_ttl_s": 600})
    ok = load_settings(transport={"default_ttl_s": 60, "janitor_interval_s": 20})
    assert ok.transport.max_ref_lifetime_s == 86400.0
    assert load_settings(transport={"default_ttl_s": 60, "janitor_interval_s": 0})


# -- the store: bound segments on real files ----------------------------------------------
@pytest.fixture
def store() -> Iterator[ShmStore]:
    root = Path("/dev/shm") / f"mmfleet-test-lifetime-{uuid.uuid4().hex[:8]}"
    s = ShmStore(root, default_ttl_s=TTL, max_lifetime_s=CAP)
    yield s
    s.close()
    shutil.rmtree(root, ignore_errors=True)


def path_of(store: ShmStore, seg_id: str) -> Path:
    return store.root / f"{seg_id}.arrow"


def test_a_renewed_segment_outlives_its_ttl_until_the_cap(store: ShmStore) -> None:
    arr = np.arange(1000, dtype=np.uint8)
    bound = store.put(arr, detach=True, request_id="req-1")
    plain = store.put(arr, detach=True)
    c = bound.created_at
    assert store.info(bound.id).request == "req-1" and store.info(plain.id).request == ""
    assert lifetime.renew(path_of(store, bound.id), c + 500)
    assert lifetime.renew(path_of(store, plain.id), c + 500)  # no effect: not bound
    assert store.info(bound.id).expires_at == pytest.approx(c + 500 + TTL, abs=1e-3)
    assert store.gc(now=c + TTL + 1) == [plain.id]
    assert store.gc(now=c + 500 + TTL - 1) == []
    assert store.gc(now=c + 500 + TTL + 1) == [bound.id]

    capped = store.put(arr, detach=True, request_id="req-2")
    assert lifetime.renew(path_of(store, capped.id), capped.created_at + 10 * CAP)
    assert store.gc(now=capped.created_at + CAP - 1) == []
    assert store.gc(now=capped.created_at + CAP + 1e-3) == [capped.id]  # metadata: µs


def test_gc_takes_the_inputs_of_finished_requests_before_their_lease_ends(
    store: ShmStore,
) -> None:
    arr = np.arange(1000, dtype=np.uint8)
    done = store.put(arr, detach=True, request_id="done")
    running = store.put(arr, detach=True, request_id="running")
    plain = store.put(arr, detach=True)
    now = done.created_at + 1  # every lease and TTL has a minute left
    assert store.gc(now=now, finished={"done", "other"}) == [done.id]
    assert {s.id for s in store.ls()} == {running.id, plain.id}


def test_a_read_counts_the_renewals_of_a_bound_segment_only(store: ShmStore) -> None:
    arr = np.arange(1000, dtype=np.uint8)
    bound = store.put(arr, detach=True, request_id="req-1", ttl_s=1e-6)  # lapsed at once
    plain = store.put(arr, detach=True, ttl_s=1e-6)
    for ref in (bound, plain):
        with pytest.raises(TensorRefError, match="expired"):
            store.get(ref)
        # a renewal stamped a minute ahead: a lease until then, for a bound segment only
        assert lifetime.renew(path_of(store, ref.id), time.time() + 60)
    np.testing.assert_array_equal(store.get(bound), arr)
    # the file decides, not the ref: neither the mtime nor a forged TTL revives it
    forged = plain.model_copy(update={"ttl_s": 1e9})
    with pytest.raises(TensorRefError, match="expired"):
        store.get(forged)


def test_a_malformed_request_id_is_refused_at_put(store: ShmStore) -> None:
    with pytest.raises(ValueError, match="request_id"):
        store.put(np.ones(10, np.uint8), request_id="../x")
    assert list(store.root.iterdir()) == []


def test_renew_refuses_what_is_not_a_segment_file(store: ShmStore, tmp_path: Path) -> None:
    assert not lifetime.renew(store.root / "t" / "missing.arrow", 1.0)
    link = store.root / f"t{'0' * 32}.arrow"
    link.symlink_to(tmp_path)
    assert not lifetime.renew(link, 1.0)
    link.unlink()


# -- the renewers -----------------------------------------------------------------------
def test_shm_refs_are_found_in_inputs() -> None:
    ref = {"kind": "shm", "id": "t" + "a" * 32}
    inline = {"kind": "inline", "b64": ""}
    assert list(shm_ref_ids({"video_ref": ref})) == [ref["id"]]
    assert list(shm_ref_ids({"x": [inline, {"y": ref}], "text": "hi"})) == [ref["id"]]
    assert list(shm_ref_ids({"text": "no refs"})) == []


def test_the_worker_renews_only_its_own_requests_inputs(store: ShmStore) -> None:
    arr = np.ones(100, np.uint8)
    mine = store.put(arr, detach=True, request_id="mine")
    other = store.put(arr, detach=True, request_id="other")
    plain = store.put(arr, detach=True)
    inputs = {"a": mine.to_dict(), "b": [other.to_dict(), plain.to_dict()]}
    now = mine.created_at + 3 * TTL  # lapsed: nobody renewed it while it waited
    assert renew_inputs(lambda: store, inputs, "mine", now=now) == [mine.id]
    assert store.info(mine.id).expires_at == pytest.approx(now + TTL, abs=1e-3)
    assert store.info(other.id).expires_at == pytest.approx(other.created_at + TTL, abs=0.05)
    # unknown and malformed refs are the adapter's to refuse
    gone = {"kind": "shm", "id": "t" + "0" * 32}
    assert renew_inputs(lambda: store, {"v": gone}, "mine", now=now) == []
    # inputs without refs never open the store
    assert renew_inputs(lambda: pytest.fail("opened"), {"text": "hi"}, "mine") == []


def test_the_janitor_renews_when_redis_cannot_tell(store: ShmStore) -> None:
    """Redis unreachable (a closed port): the inputs of requests that may be queued are
    kept; the lifetime cap bounds what that costs."""
    settings = load_settings(transport={"default_ttl_s": TTL, "janitor_interval_s": 10})
    closed = redis.Redis(port=free_port_block(1), socket_connect_timeout=1, socket_timeout=1)
    renewer = SegmentRenewer(settings, interval_s=10.0, client=closed)
    ref = store.put(np.ones(100, np.uint8), detach=True, request_id="queued")
    early = store.put(np.ones(100, np.uint8), detach=True, request_id="later")
    os.utime(path_of(store, early.id), (ref.created_at + 30, ref.created_at + 30))
    now = ref.created_at + TTL - 15  # 15 s left < 2 intervals; the other has 45 s
    assert renewer.renew_due(store, now=now) == [ref.id]
    assert renewer.unknown == 1 and renewer.renewed == 1
    assert store.info(ref.id).expires_at == pytest.approx(now + TTL, abs=1e-3)


def test_a_collection_when_redis_cannot_tell_renews_nothing_and_removes_lapsed_leases(
    store: ShmStore,
) -> None:
    """``fleet shm gc`` after ``fleet down``: no Redis to ask. A lapsed lease goes; a live
    one, due or not, is left to run out, never renewed."""
    settings = load_settings(transport={"default_ttl_s": TTL, "janitor_interval_s": 10})
    closed = redis.Redis(port=free_port_block(1), socket_connect_timeout=1, socket_timeout=1)
    renewer = SegmentRenewer(settings, interval_s=10.0, client=closed)
    lapsed = store.put(np.ones(100, np.uint8), detach=True, request_id="lapsed", ttl_s=1.0)
    due = store.put(np.ones(100, np.uint8), detach=True, request_id="due")
    now = due.created_at + TTL - 15  # 15 s left < 2 intervals; the other lapsed long ago
    done = renewer.collect(store, now=now)
    assert done.removed == [lapsed.id] and done.renewed == [] and done.finished == []
    assert done.final == {"due": None, "lapsed": None} and "ConnectionError" in str(done.cause)
    assert store.info(due.id).expires_at == pytest.approx(due.created_at + TTL, abs=1e-3)


# -- producers bind a video to the request that carries it -------------------------------
def test_video_inputs_are_bound_to_the_request_that_carries_them(store: ShmStore) -> None:
    from producer.client import FleetClient, SubmitRequest
    from shared.errors import InvalidInput

    # explicit credentials: no run dir needed (nothing connects to Redis here)
    settings = load_settings(redis={"password": "unused"}, transport={"shm_root": store.root})
    client = FleetClient(settings)
    try:
        video = bytes(64 * 1024)  # over the inline threshold: through /dev/shm
        inputs = client.video_inputs(video)
        seg_id = inputs["video_ref"]["id"]
        request = client.shm().info(seg_id).request
        assert request and client._task_id(SubmitRequest("video", inputs), "fresh") == request
        with pytest.raises(InvalidInput, match="made for request"):
            client._task_id(SubmitRequest("video", inputs, task_id="another"), "fresh")
        # the gateway knows its job id: bound to it, nothing remembered
        explicit = client.video_inputs(video, task_id="job-1")
        assert client.shm().info(explicit["video_ref"]["id"]).request == "job-1"
        assert (
            client._task_id(SubmitRequest("video", explicit, task_id="job-1"), "fresh") == "job-1"
        )
        assert client.release_inputs(inputs) == 1 and client.release_inputs(explicit) == 1
        assert client._bound == {}
    finally:
        client.close()

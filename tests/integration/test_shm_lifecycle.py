"""/dev/shm goes back to its baseline, and Redis never carries tensor bytes, on a real stack.

A stack of its own (Redis + one text worker; the probe task runs on the ``text`` queue) with a
shared-memory root of its own, so that "back to baseline" means exactly the same set of
files, whatever else runs on the machine, and with a short default TTL for the crash test.
The worker warms its model at one small shape only (the probe does not use it).
"""

from __future__ import annotations

import os
import shutil
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis as redis_lib

from producer.client import FleetClient
from shared.transport import ShmStore
from tests.conftest import REPO, ops_app
from workers.probe import PROBE_TASK, byte_checksum

pytestmark = pytest.mark.integration

TTL_S = 4.0  # the stack's transport.default_ttl_s: what a crashed worker's leftovers live
PEEK_QUEUE = "peek"  # nobody consumes it: a message sent there can be read back raw
KIB, MIB = 1 << 10, 1 << 20


@pytest.fixture(scope="module")
def shm_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from producer.stack.local import Stack, isolated_environment

    root = Path(f"/dev/shm/mmfleet-{os.getuid()}-lifecycle-{uuid.uuid4().hex[:12]}")
    overrides = {
        "FLEET_CONFIG": str(REPO / "configs" / "fleet.toml"),
        "FLEET_TRANSPORT__SHM_ROOT": str(root),
        "FLEET_TRANSPORT__DEFAULT_TTL_S": str(TTL_S),
        "FLEET_REDIS__LEASE_S": "1",  # tensors must outlive 4 leases (checked at load)
        "FLEET_TRANSPORT__JANITOR_INTERVAL_S": "1",  # and 3 janitor intervals
        "FLEET_MODALITIES__TEXT__BATCHING__MAX_BATCH_SIZE": "1",
        "FLEET_MODALITIES__TEXT__BATCHING__PREFERRED_BATCH_SIZES": "[1]",
        "FLEET_MODALITIES__TEXT__BATCHING__LENGTH_BUCKETS": "[16]",
    }
    with isolated_environment(tmp_path_factory.mktemp("shm-run"), overrides) as settings:
        st = Stack(settings)
        try:
            st.up(["text"], flower=False)
            yield st
        finally:
            st.down()
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def sclient(shm_stack: Any) -> Iterator[FleetClient]:
    if not shm_stack.alive("worker-text"):  # the crash test kills it
        shm_stack.start_worker("text")
    # an operator's client: these tests publish to probe queues nobody reads and forget the
    # results they read, both beyond a producer's rights (shared.acl)
    client = FleetClient(shm_stack.s, role="operator")
    yield client
    client.app.close()


def files(store: ShmStore) -> set[str]:
    return set(os.listdir(store.root))


def worker_pid(stack: Any) -> int:
    pid = stack._read_pid(stack.pids / "worker-text.pid")
    assert pid is not None
    return int(pid)


def mapped_from(pid: int, root: Path) -> list[str]:
    """Lines of ``/proc/<pid>/maps`` that map a file of ``root`` (released ones included)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return []
    return [ln for ln in maps.splitlines() if str(root) in ln]


def stored_memory(redis: Any) -> int:
    """Redis ``used_memory`` less every client's I/O buffers (``tot-mem``), read atomically.

    Raw ``used_memory`` moves by 32-64 KiB several times a second on an idle stack: each
    client's query buffer is allocated when a command arrives (the worker's BRPOPs, every
    second) and freed when it idles. Without them it holds still to within a few hundred bytes.
    """
    pipe = redis.pipeline(transaction=True)
    pipe.info("memory")
    pipe.client_list()
    info, clients = pipe.execute()
    return int(info["used_memory"]) - sum(int(c["tot-mem"]) for c in clients)


def send(client: FleetClient, wire: dict[str, Any], queue: str = "text") -> Any:
    return client.app.send_task(PROBE_TASK, kwargs={"tensor": wire}, queue=queue)


def test_back_to_baseline_after_1000_requests(sclient: FleetClient, shm_stack: Any) -> None:
    store = sclient.shm()
    baseline = files(store)
    tensors = [np.random.default_rng(i).standard_normal(n // 4, dtype=np.float32)
               for i, n in enumerate((64 * KIB, 256 * KIB, 1 * MIB))]  # fmt: skip
    sums = [byte_checksum(t) for t in tensors]
    done = 0
    for _wave in range(10):  # 100 in flight at a time
        sent = []
        for i in range(100):
            k = (done + i) % len(tensors)
            ref = store.put(tensors[k], detach=True, ttl_s=120.0)
            sent.append((k, ref, send(sclient, ref.to_dict())))
        for k, ref, res in sent:
            out = res.get(timeout=60)
            assert store.release(ref)  # released as soon as its result is in
            res.forget()
            assert out["nbytes"] == tensors[k].nbytes
            assert out["checksum"] == sums[k]
        done += len(sent)
    assert done == 1000
    # What stays while the client lives: released files kept for reuse (the 1 MiB tensors'
    # files, rewritten in place by later puts), within the recycle budget, nothing else.
    assert store.kept_puts > 0
    assert all(name.startswith(".pool-") for name in files(store) - baseline)
    assert store.used_bytes() == store.pool_bytes() <= store.recycle_bytes
    sclient.close()  # gives the kept files back
    assert files(store) == baseline
    assert store.used_bytes() == 0
    # Nothing of the root stays mapped by the worker (that would keep the pages alive): its
    # reader cache drops mappings of unlinked files within its sweep interval (1 s).
    pid = worker_pid(shm_stack)
    deadline = time.monotonic() + 10
    while mapped_from(pid, store.root) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert mapped_from(pid, store.root) == []


def _peek_message_bytes(client: FleetClient, wire: dict[str, Any]) -> int:
    """Length of the raw Redis entry of a probe message (sent to a queue nobody reads)."""
    ops = ops_app(client.settings).backend  # raw reads of queues are the operator's
    redis = ops.client
    res = send(client, wire, queue=PEEK_QUEUE)
    try:
        keys = [k for k in redis.scan_iter(match=f"{PEEK_QUEUE}*")
                if redis.type(k) in (b"list", "list")]  # fmt: skip
        raw = [m for k in keys for m in redis.lrange(k, 0, -1)]
        assert len(raw) == 1
        return len(raw[0])
    finally:
        for k in redis.scan_iter(match=f"{PEEK_QUEUE}*"):
            redis.delete(k)
        redis.delete(f"_kombu.binding.{PEEK_QUEUE}", f"_kombu.binding_permanent.{PEEK_QUEUE}")
        ops.forget(res.id)


def test_redis_memory_does_not_grow_with_tensor_size(sclient: FleetClient) -> None:
    store = sclient.shm()
    # INFO and CLIENT LIST (each client's buffers) are the admin's
    redis = redis_lib.Redis.from_url(sclient.settings.redis_url("admin"))
    small = np.ones(64 * KIB // 4, np.float32)
    big = np.ones(64 * MIB // 4, np.float32)

    # The raw messages: a ref, the same few hundred bytes whatever the tensor's size.
    sizes = []
    for arr in (small, big):
        ref = store.put(arr, detach=True, ttl_s=120.0)
        try:
            sizes.append(_peek_message_bytes(sclient, ref.to_dict()))
        finally:
            store.release(ref)
    assert max(sizes) < 64 * KIB
    assert sizes[1] - sizes[0] < 64  # a few more shape digits, nothing else

    def roundtrip(arr: np.ndarray) -> int:
        ref = store.put(arr, detach=True, ttl_s=120.0)
        try:
            res = send(sclient, ref.to_dict())
            assert res.get(timeout=60)["nbytes"] == arr.nbytes
            res.forget()
        finally:
            store.release(ref)
        return stored_memory(redis)

    for arr in (small, big, small, big):  # connections and structures set up
        roundtrip(arr)
    after_small, after_big = [], []
    for _ in range(3):
        after_small.append(roundtrip(small))
        after_big.append(roundtrip(big))
    # 16 KiB: Redis's own bookkeeping moves by a few KiB between calls; a 64 MiB tensor
    # through Redis would show as 64 MiB.
    assert max(abs(b - a) for a, b in zip(after_small, after_big, strict=True)) < 16 * KIB, (
        after_small,
        after_big,
    )


def test_worker_killed_mid_task_leaves_nothing_after_the_ttl(
    sclient: FleetClient, shm_stack: Any
) -> None:
    store = sclient.shm()
    assert store.default_ttl_s == TTL_S
    store.trim_pool()  # earlier tests' released files: gc would take them once idle 30 s
    baseline = files(store)
    pid = worker_pid(shm_stack)
    arr = np.ones(256 * MIB // 4, np.float32)  # the probe reads it for a good fraction of 1 s
    ref = store.put(arr, detach=True)  # the default TTL of this stack
    send(sclient, ref.to_dict())
    seg = f"{ref.id}.arrow"
    deadline = time.monotonic() + 30
    # (the worker may still keep mappings of earlier tests' files: wait for this one)
    while not any(seg in ln for ln in mapped_from(pid, store.root)):
        assert time.monotonic() < deadline, "the probe never mapped it"
        time.sleep(0.001)
    os.killpg(pid, signal.SIGKILL)  # mid-task: the worker holds the mapping
    while shm_stack.alive("worker-text"):
        time.sleep(0.01)
    # The producer never got a result and never releases: only the TTL frees the segment.
    assert seg in files(store)
    assert store.gc() == []  # not expired yet: a reader might still come
    time.sleep(max(0.0, ref.expires_at - time.time()) + 0.05)
    assert store.gc() == [ref.id]
    assert files(store) == baseline
    assert time.time() - ref.created_at < TTL_S + 2.0

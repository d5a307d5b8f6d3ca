"""Real text workers while their real Redis refuses writes but still answers (issue 30,
item 1): ``MISCONF`` (the AOF's disk is full: a tmpfs the test fills), ``OOM`` (``maxmemory``
with ``noeviction``), ``READONLY`` (Redis made a replica of a dead primary), ``NOPERM`` (an ACL
rule takes the worker user's write commands).

Each test holds work in the worker when the fault starts (a slow batch, the window full
behind it), keeps the fault for longer than a lease (every held lease goes stale), starts a
second worker meanwhile, then ends the fault. The worker must never exit, must stop
fetching and say why (its log, ``fleet_worker_broker_refusing{reason}``), and resume by
itself; the second worker must get ready and wait; every request accepted before or during
the fault ends once, as a success, within 15 s of the fault's end: no held message may be
handed to the other worker while its holder had not renewed it yet.

Before the fix, ``MISCONF`` ended the running worker (``Unrecoverable error`` from the
fetch's subscribed connection, whose ``PING`` Redis refuses with the writes) and a worker
started meanwhile never got ready.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from producer.client import FleetClient, ResultHandle, SubmitRequest
from producer.stack.local import free_port
from producer.tools.chaos.aof_tmpfs import AofOnTmpfs, MountRefused
from shared import schema
from shared.procs import running
from tests.conftest import REPO, free_port_block, own_text_stack

pytestmark = pytest.mark.integration

LEASE_S = 4.0  # leases lapse 2.8 s after their last renewal (lease_expiry_s)
FAULT_MIN_S = 3 * LEASE_S  # every lease held when the fault began is stale by its end
RECOVER_LIMIT_S = 15.0  # the goal: every request final within this of the fault's end
SECOND = "worker-text-1"
HOLDER_LATE_S = 1.5  # the holder's first renewal after the fault comes this late at least
BULK = ("bulk", 600.0)  # priority, deadline: no request may miss its deadline in the fault


@pytest.fixture(scope="module")
def refusal_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    overrides = {
        "FLEET_CONFIG": str(REPO / "configs" / "fleet.toml"),
        "FLEET_REDIS__LEASE_S": str(LEASE_S),
        "FLEET_DEBUG__FAULT_INJECTION": "true",
        "FLEET_METRICS__PORT_BASE": str(free_port_block(8)),  # text 0 at +0, text 1 at +4
        "FLEET_MODALITIES__TEXT__BATCHING__MAX_BATCH_SIZE": "8",
        "FLEET_MODALITIES__TEXT__BATCHING__LENGTH_BUCKETS": "[16]",
    }
    with own_text_stack(tmp_path_factory, "refusal-run", overrides) as st:
        yield st


# -- the faults: each refuses the worker user's writes until its block ends ----------------
def _admin(st: Any) -> redis.Redis:
    return redis.Redis.from_url(st.s.redis_url("admin"), socket_timeout=10)


def _worker_write_refused(st: Any) -> bool:
    """Whether Redis refuses the worker user a lease renewal (``ZADD XX`` of a member that
    is not there: it changes nothing when accepted)."""
    r = redis.Redis.from_url(st.s.redis_url("worker"), socket_timeout=5)
    try:
        r.zadd(schema.UNACKED_INDEX_KEY, {"refusal-probe": 0}, xx=True)
    except redis.ResponseError:
        return True
    finally:
        r.close()
    return False


def _wait(check: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    end = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > end:
            raise TimeoutError(what)
        time.sleep(0.05)


@contextlib.contextmanager
def disk_full(st: Any) -> Iterator[None]:
    try:
        aof = AofOnTmpfs(_admin(st), size_mb=32)
        aof.__enter__()
    except MountRefused as exc:
        pytest.skip(f"no tmpfs for the AOF here: {exc}")
    try:
        aof.fill()
        yield
        aof.free()
    finally:
        aof.__exit__(None, None, None)


@contextlib.contextmanager
def out_of_memory(st: Any) -> Iterator[None]:
    admin = _admin(st)
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", 1)
    try:
        yield
    finally:
        admin.config_set("maxmemory", 0)


@contextlib.contextmanager
def read_only(st: Any) -> Iterator[None]:
    admin = _admin(st)
    admin.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))  # nothing listens
    try:
        yield
    finally:
        admin.execute_command("REPLICAOF", "NO", "ONE")


@contextlib.contextmanager
def no_write_permission(st: Any) -> Iterator[None]:
    admin = _admin(st)
    user = st.s.redis_credentials("worker")[0] or "default"
    line = next(
        ln.decode() if isinstance(ln, bytes) else ln
        for ln in admin.acl_list()
        if (ln.decode() if isinstance(ln, bytes) else ln).startswith(f"user {user} ")
    )
    admin.execute_command("ACL", "SETUSER", user, "-@write")
    try:
        yield
    finally:
        admin.execute_command("ACL", "SETUSER", user, "reset", *line.split()[2:])
        admin.acl_log_reset()


FAULTS: dict[str, Callable[[Any], contextlib.AbstractContextManager[None]]] = {
    "MISCONF": disk_full,
    "OOM": out_of_memory,
    "READONLY": read_only,
    "NOPERM": no_write_permission,
}


# -- what the test reads --------------------------------------------------------------------
def _log(st: Any, name: str) -> str:
    path = st.logs / f"{name}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def _refusing(st: Any) -> dict[str, float]:
    """``fleet_worker_broker_refusing`` of the first text worker, by reason."""
    port = st.s.metrics.port_base  # text is modality 0
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'^fleet_worker_broker_refusing\{reason="(\w+)"\} (\S+)$', text, re.M)
    }


def _ready(st: Any, name: str, since: Callable[[str], str]) -> bool:
    """Whether worker ``name`` logged that it is ready (an exit fails at once)."""
    if "fleet worker ready" in since(name):
        return True
    assert st.alive(name), f"{name} exited while starting:\n{since(name)[-3000:]}"
    return False


class Submitter:
    """Submits a text every 0.2 s from a thread; keeps the handles Redis accepted."""

    def __init__(self, client: FleetClient) -> None:
        self.client = client
        self.accepted: list[ResultHandle] = []
        self.refused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Submitter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        i = 0
        while not self._stop.wait(0.2):
            i += 1
            try:
                self.accepted.append(self.client.submit("text", {"text": f"during {i}"}, *BULK))
            except Exception:  # Redis refuses the producer too (all but NOPERM)
                self.refused += 1


@pytest.mark.parametrize("reason", list(FAULTS))
def test_a_worker_lives_through_redis_refusing_writes(refusal_stack: Any, reason: str) -> None:
    st = refusal_stack
    if not st.alive("worker-text"):  # an earlier mode ended it (the test failed then)
        st.stop("worker-text", timeout_s=1)
        st.start_worker("text")
    pid = st._read_pid(st.pids / "worker-text.pid")
    _wait(lambda: not any(_refusing(st).values()), "no refusal left from before", 30)
    client = FleetClient(st.s)
    admin = _admin(st)
    mark = {n: len(_log(st, n)) for n in ("worker-text", SECOND)}

    def since(name: str) -> str:
        return _log(st, name)[mark[name] :]

    # Work held when the fault begins: a slow batch runs, the window holds the rest.
    before = client.submit_many(
        SubmitRequest(
            "text", {"text": f"before {i}", **({"_inject": "slow:3"} if i == 0 else {})}, *BULK
        )
        for i in range(40)
    )
    _wait(lambda: admin.hlen(schema.UNACKED_KEY) >= 30, "the worker holds the requests")
    try:
        with Submitter(client) as during:
            with FAULTS[reason](st):
                began = time.monotonic()
                assert _worker_write_refused(st)
                st._spawn(SECOND, st.worker_argv("text", replica=1))  # started while refusing
                _wait(lambda: _ready(st, SECOND, since), "second worker ready", 120)
                while time.monotonic() - began < FAULT_MIN_S:
                    time.sleep(0.1)
                assert st.alive("worker-text") and st.alive(SECOND)
                metric_during = _refusing(st)
                assert _worker_write_refused(st)
                # The holder renews late after the fault (a busy host, a pause): its leases
                # are stale then, and the second worker, which can write again, must not
                # return its messages meanwhile.
                os.killpg(pid, signal.SIGSTOP)
            ended = time.monotonic()
            try:
                time.sleep(HOLDER_LATE_S)
            finally:
                os.killpg(pid, signal.SIGCONT)
        handles = before + during.accepted
        outs = client.wait_all(handles, timeout_s=60)
        final_s = time.monotonic() - ended
        bad = {h.id: o for h, o in zip(handles, outs, strict=True) if o is None or "error" in o}
        assert bad == {}, "every request accepted before or during the fault succeeds"
        assert final_s <= RECOVER_LIMIT_S
        time.sleep(3 * LEASE_S)  # a copy handed out late would run by now
        logs = since("worker-text") + since(SECOND)
        runs = {h.id: len(re.findall(rf"request id={h.id} state=SUCCESS\b", logs)) for h in handles}
        assert {i: n for i, n in runs.items() if n != 1} == {}, "each request ran exactly once"
        assert "state=DUPLICATE" not in logs, "a held message was handed to another worker"
        assert st.alive("worker-text") and st._read_pid(st.pids / "worker-text.pid") == pid
        assert st.alive(SECOND)
        assert "Unrecoverable error" not in logs
        assert admin.hlen(schema.UNACKED_KEY) == 0
        # What the operator sees: the log lines and the metric, during and after.
        assert f"Redis refuses writes ({reason}" in since("worker-text")
        assert "Redis accepts writes again" in since("worker-text")
        assert metric_during.get(reason) == 1.0, metric_during
        assert _refusing(st).get(reason) == 0.0
    finally:
        client.close()
        pid2 = st._read_pid(st.pids / f"{SECOND}.pid")
        st.stop(SECOND, timeout_s=30)
        assert pid2 is None or not running(pid2)

"""``python -m producer.tools.bench.redissteps``: what each step of a request's Redis path costs
Redis, step by step, replayed with the product's own code against a Redis of its own.

``redisload`` and ``fleet bench overhead-saturate`` give one figure for the whole path;
this splits it. On a stack of its own (``fleet up``'s Redis: its ACL users, AOF
``everysec``, list keyspace notifications; no worker), ``requests`` BULK texts go through
each step in turn, each step for all of them before the next, as the worker would run them
(the same code, the same Redis users):

=========== ==================================================================================
step        what runs
=========== ==================================================================================
``submit``  ``FleetClient.submit_many`` (the producer: the messages and their ``task-sent``
            events)
``take``    the take script (``workers/consumer/take_many.lua``) as the worker's channel calls
            it, ``--take`` messages a call, from the queue's priority lists
``begin``   the batch gate (``InFlight.begin``: ``inflight_begin.lua``), ``--batch`` ids a call
``write``   the final results (``ResultWriter.write``: ``results_write_first.lua``), the
            identity model's result, ``--batch`` a call
``ack``     the acks (``LeaseKeeper.ack``: ``ZREM`` + ``HDEL``), ``--batch`` a call; with
            ``--acks-in-write``, as the worker settles a group: each batch's acks go in its
            ``write`` call (after its results), and this step sends nothing
``read``    the producer's read of every result (``FleetClient.wait_all``: ``MGET``)
=========== ==================================================================================

Per step, from ``INFO cpu`` and ``INFO commandstats`` before and after (the medians over
``--repeats`` runs, each on an emptied database):

- ``cpu_us``: Redis CPU per request (``used_cpu_sys + used_cpu_user``, the main process);
- ``commands``: commands per request sent by the client (a script's or a transaction's own
  commands not counted), and ``by_command``: usec per request inside each command as
  ``commandstats`` counts it (a script's ``evalsha`` includes the commands it calls, which
  are also listed under their own names);
- ``in_scripts_beyond_commands_us``: what a script's ``evalsha`` (a transaction's ``exec``)
  spent beyond the commands it ran: the interpreter, building their arguments and parsing
  their replies, feeding its writes to the AOF;
- ``outside_commands_us``: ``cpu_us`` less the time inside the client's commands: reading and
  parsing requests, writing replies and pubsub messages, the AOF's ``write``, the event loop.

``--subscriber`` adds one ``PSUBSCRIBE celery-task-meta-*`` client, as the bench's result
collector (every ``PUBLISH`` of a result then reaches a subscriber); ``--no-aof`` turns the
AOF off (``CONFIG SET appendonly no``) to show what it costs. Redis is single-threaded: a
step's ``cpu_us`` is what it takes from the one core all requests share. On a shared VM
figures move by 10-20 % between runs: compare variants within one invocation or over
several ``--repeats``.

Writes one JSON object (``--out``, and stdout)::

    {"started_utc", "redis_version", "requests", "batch", "take", "aof", "subscriber",
     "acks_in_write", "message_bytes", "repeats",
     "steps": {step: {"cpu_us", "commands", "in_scripts_beyond_commands_us",
                      "outside_commands_us", "by_command": {cmd: usec}}},
     "total_cpu_us"}
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from producer.tools.bench.accounting import counter_delta, redis_counters

REPO = Path(__file__).resolve().parents[3]

STEPS = ("submit", "take", "begin", "write", "ack", "read")

# Per step: the commands that wrap others (a script's EVALSHA, a transaction's EXEC), whose
# usec include those they run; and the commands run inside them, counted by commandstats
# under their own names too.
WRAPPERS: dict[str, frozenset[str]] = {
    "submit": frozenset({"exec"}),
    "take": frozenset({"evalsha"}),
    "begin": frozenset({"evalsha"}),
    "write": frozenset({"evalsha"}),
    "ack": frozenset(),
    "read": frozenset(),
}
NESTED: dict[str, frozenset[str]] = {
    "submit": frozenset({"lpush"}),
    "take": frozenset({"rpop", "rpush", "hset", "zadd"}),
    "begin": frozenset({"exists", "mget", "set", "sadd"}),
    "write": frozenset({"get", "mget", "exists", "set", "setex", "publish", "zrem", "hdel"}),
    "ack": frozenset(),
    "read": frozenset(),
}
IGNORED = frozenset({"info", "script", "client", "auth", "hello", "ping", "time", "select"})


def step_figures(
    calls: Mapping[str, int],
    usec: Mapping[str, int],
    cpu_s: float,
    requests: int,
    wrappers: Iterable[str] = (),
    nested: Iterable[str] = (),
) -> dict[str, Any]:
    """One step's figures per request from its counter deltas (module doc).

    Args:
        calls: commandstats calls by command over the step.
        usec: commandstats usec by command over the step.
        cpu_s: Redis CPU seconds over the step.
        requests: the requests the step served.
        wrappers: the commands that run others (their usec include them).
        nested: the commands that ran inside a wrapper (counted under their names too).
    """
    wrappers, nested = frozenset(wrappers), frozenset(nested)
    calls = {k: v for k, v in calls.items() if k not in IGNORED}
    usec = {k: v for k, v in usec.items() if k not in IGNORED}
    sent = sum(n for cmd, n in calls.items() if cmd not in nested)
    inside_sent = sum(u for cmd, u in usec.items() if cmd not in nested)
    beyond = sum(u for cmd, u in usec.items() if cmd in wrappers) - sum(
        u for cmd, u in usec.items() if cmd in nested
    )
    return {
        "cpu_us": round(cpu_s * 1e6 / requests, 2),
        "commands": round(sent / requests, 3),
        "in_scripts_beyond_commands_us": round(max(beyond, 0) / requests, 2),
        "outside_commands_us": round((cpu_s * 1e6 - inside_sent) / requests, 2),
        "by_command": {
            cmd: round(u / requests, 2) for cmd, u in sorted(usec.items(), key=lambda x: -x[1])
        },
    }


def median_figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per figure, the median over runs of one step (``by_command``: per command)."""
    out: dict[str, Any] = {}
    for key in ("cpu_us", "commands", "in_scripts_beyond_commands_us", "outside_commands_us"):
        out[key] = round(statistics.median(r[key] for r in runs), 2)
    cmds = {c for r in runs for c in r["by_command"]}
    by = {c: round(statistics.median(r["by_command"].get(c, 0.0) for r in runs), 2) for c in cmds}
    out["by_command"] = dict(sorted(by.items(), key=lambda x: -x[1]))
    return out


class _Meter:
    """Counter deltas of one Redis around a step."""

    def __init__(self, admin: Any) -> None:
        self.admin = admin

    def run(self, step: str, requests: int, fn: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
        c0, u0, cpu0 = redis_counters(self.admin)
        out = fn()
        c1, u1, cpu1 = redis_counters(self.admin)
        figures = step_figures(
            counter_delta(c0, c1),
            counter_delta(u0, u1),
            cpu1 - cpu0,
            requests,
            WRAPPERS[step],
            NESTED[step],
        )
        return out, figures


class _Acks:
    """A batch's acks carried by its result write (``workers.consumer.lease.AckPlan``'s Redis
    side: its tags, no tenant's release)."""

    def __init__(self, tags: list[str]) -> None:
        self.tags, self.also = tags, ()

    def finish(self, release: bool = True) -> int:
        return len(self.tags)


def _one_run(
    settings: Any, requests: int, batch: int, take_n: int, acks_in_write: bool = False
) -> dict[str, Any]:
    """Every step once for ``requests`` new requests; their figures by step."""
    from producer.client import FleetClient, SubmitRequest
    from shared import schema
    from shared.celery_app import make_app
    from shared.redis_client import redis_client
    from workers.batching.admission import InFlight
    from workers.batching.completion import Outcome, ResultWriter
    from workers.consumer.channel import TAKE_MANY
    from workers.consumer.lease import LeaseKeeper
    from workers.models.identity import identity_result

    admin = redis_client(settings)
    worker = redis_client(settings, "worker")
    meter = _Meter(admin)
    texts = [
        t for t in (REPO / "data/text/botchan_sentences.txt").read_text().splitlines() if t.strip()
    ]
    reqs = [SubmitRequest("text", {"text": texts[i % len(texts)]}, "bulk") for i in range(requests)]
    client = FleetClient(settings)
    figures: dict[str, Any] = {}
    try:
        handles, figures["submit"] = meter.run("submit", requests, lambda: client.submit_many(reqs))
        ids = [h.id for h in handles]
        queues = (schema.queue_name("text"), schema.realtime_queue_name("text"))
        keys = [schema.priority_list_key(q, p) for p in schema.PRIORITY_STEPS for q in queues]
        keys += [schema.UNACKED_KEY, schema.UNACKED_INDEX_KEY]
        take = worker.register_script(TAKE_MANY)

        def take_all() -> list[bytes]:
            items: list[bytes] = []
            while len(items) < requests:
                flat = take(keys=keys, args=[take_n, repr(time.time()), 0], client=worker)
                if not flat:
                    break
                items += flat[1::2]
            return items

        items, figures["take"] = meter.run("take", requests, take_all)
        if len(items) != requests:
            raise RuntimeError(f"took {len(items)} of {requests} messages")
        tags = [schema.loads(m)["properties"]["delivery_tag"] for m in items]
        chunks = [ids[i : i + batch] for i in range(0, requests, batch)]
        inflight = InFlight(worker, 600)
        _, figures["begin"] = meter.run(
            "begin", requests, lambda: [inflight.begin(c) for c in chunks]
        )
        writer = ResultWriter(make_app(settings, name="redissteps", role="worker"))
        keeper = LeaseKeeper(worker, renew_s=60.0)

        def write_all() -> None:
            for n, c in enumerate(chunks):
                outcomes = [Outcome(t, result=identity_result(t.encode())) for t in c]
                acks = _Acks(tags[n * batch : (n + 1) * batch]) if acks_in_write else None
                if not all(writer.write(outcomes, acks=acks)):
                    raise RuntimeError("a result write found a final result standing")

        def ack_all() -> None:
            if not acks_in_write:
                for i in range(0, requests, batch):
                    keeper.ack(tags[i : i + batch])

        _, figures["write"] = meter.run("write", requests, write_all)
        _, figures["ack"] = meter.run("ack", requests, ack_all)
        outs, figures["read"] = meter.run("read", requests, lambda: client.wait_all(handles))
        if sum(1 for o in outs if o is not None and "result" in o) != requests:
            raise RuntimeError("a request has no result")
    finally:
        client.close()
    return figures


def measure(
    requests: int,
    batch: int,
    take_n: int,
    repeats: int,
    workdir: Path,
    aof: bool = True,
    subscriber: bool = False,
    acks_in_write: bool = False,
) -> dict[str, Any]:
    """The figures of every step (medians over ``repeats`` runs) on a Redis of its own."""
    from producer.stack.local import Stack
    from producer.stack.ports import isolated_environment
    from shared.redis_client import redis_client

    overrides = {"FLEET_TRANSPORT__SHM_ROOT": str(workdir / "shm")}
    with isolated_environment(workdir, overrides) as settings:
        stack = Stack(settings)
        stack.up([], flower=False)
        pubsub = None
        try:
            admin = redis_client(settings)
            if not aof:
                admin.config_set("appendonly", "no")
            if subscriber:
                pubsub = redis_client(settings, "operator").pubsub()
                pubsub.psubscribe("celery-task-meta-*")
            version = admin.info("server")["redis_version"]
            _one_run(settings, min(requests, 500), batch, take_n, acks_in_write)  # warm-up
            runs: list[dict[str, Any]] = []
            for _ in range(repeats):
                admin.flushdb()
                if pubsub is not None:  # what it received is no step's business
                    while pubsub.get_message(timeout=0.0) is not None:
                        pass
                runs.append(_one_run(settings, requests, batch, take_n, acks_in_write))
            sample = _message_bytes(settings)
        finally:
            if pubsub is not None:
                pubsub.close()
            stack.down()
    steps = {s: median_figures([r[s] for r in runs]) for s in STEPS}
    return {
        "redis_version": version,
        "requests": requests,
        "batch": batch,
        "take": take_n,
        "aof": aof,
        "subscriber": subscriber,
        "acks_in_write": acks_in_write,
        "message_bytes": sample,
        "repeats": repeats,
        "steps": steps,
        "total_cpu_us": round(sum(s["cpu_us"] for s in steps.values()), 2),
    }


def _message_bytes(settings: Any) -> int:
    """The size of one message the producer pushes for these texts."""
    from producer.client import FleetClient, SubmitRequest
    from shared import schema
    from shared.redis_client import redis_client

    admin = redis_client(settings)
    admin.flushdb()
    client = FleetClient(settings)
    try:
        client.submit_many([SubmitRequest("text", {"text": "I was a reckless fellow."}, "bulk")])
    finally:
        client.close()
    for p in schema.PRIORITY_STEPS:
        raw = admin.lindex(schema.priority_list_key(schema.queue_name("text"), p), 0)
        if raw is not None:
            return len(raw)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--batch", type=int, default=32, help="requests per batch (begin, write, ack)")
    p.add_argument("--take", type=int, default=63, help="messages per take call")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-aof", action="store_true", help="turn the AOF off")
    p.add_argument("--subscriber", action="store_true", help="one PSUBSCRIBE to the results")
    p.add_argument(
        "--acks-in-write", action="store_true", help="each batch's acks in its write call"
    )
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    report: dict[str, Any] = {"started_utc": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
    with tempfile.TemporaryDirectory(prefix="fleet-redissteps-") as tmp:
        report.update(
            measure(
                args.requests,
                args.batch,
                args.take,
                max(args.repeats, 1),
                Path(tmp),
                aof=not args.no_aof,
                subscriber=args.subscriber,
                acks_in_write=args.acks_in_write,
            )
        )
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

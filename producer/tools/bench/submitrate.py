"""``fleet bench submit-rate``: how many requests/s one producer process enqueues, against the
raw Redis pipeline limit for the same messages, in one run.

``configs/workloads/submit-rate.toml`` gives N (its burst's ``count``, default 5,000), the
texts and classes (its mix, from the repo's real sentences), the rounds (``repetitions``).
The stack is the bench's own (a Redis on free ports in ``.run/bench/submit-rate-<time>``).

1. **Capture** (unmeasured, also the warmup): ``submit_many`` of the N requests; every
   message is read back from its priority list (``LRANGE``), so the raw path pushes exactly
   the bytes the client sent, to the same keys. The lists are then emptied.
2. **Rounds**, each running the paths in rotating order (a drift of the machine falls on
   all alike); after each path the lists' lengths are summed (``enqueued``, must be N) and
   the lists deleted, so no queue-length limit is reached:

   - ``raw``: the messages with fresh task ids and delivery tags (copies built before the
     clock starts) ``LPUSH``-ed in pipelines of ``CHUNK``, one connection, producer ACL user;
   - ``submit_many``: ``FleetClient.submit_many`` in chunks of ``CHUNK``, one thread;
   - ``submit``: ``FleetClient.submit`` one request at a time.

3. **submit_many+wait**: one text worker (batch mode, the product's settings) started; per
   round ``submit_many`` in chunks, then ``wait_all`` until every result is stored; the rate
   is N over first send to the last result's ``date_done``.

Per path and round: rate (``perf_counter``), the producer's CPU per request
(``process_time``), and Redis ``INFO commandstats`` deltas (commands per request). The report
(layout in ``report.py``) goes to ``reports/bench/submit-rate-<time>.json``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console

from producer.client import FleetClient, SubmitRequest
from producer.tools.bench.capture import CHUNK, Message, capture_messages, list_keys
from producer.tools.bench.results import BenchError
from producer.tools.bench.schedule import open_schedule
from producer.tools.bench.sources import InputCatalog
from producer.tools.bench.submitrate_report import (
    METHOD,
    SEND_PATHS,
    counter_delta,
    fresh_copy,
    per_request,
    print_submit_rate_report,
    rate,
    ratios,
    summarize_path,
    verdict,
)
from producer.tools.bench.workload import REPO, Workload
from shared.settings import Settings

WARM_REQUESTS = 20  # one-at-a-time requests through the worker before the waited rounds
# The harness's own call inside a path's window (its counting LLENs and DELs come after it).
HARNESS_COMMANDS = ("info",)


def is_submit_rate(w: Workload) -> bool:
    """Whether ``w`` is run by this module (``runner = "submit-rate"``)."""
    return w.runner == "submit-rate"


def _calls(admin: Any) -> dict[str, int]:
    stats = admin.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}


class SubmitRateBench:
    """Runs the submit-rate workload; :meth:`run` returns the report (a JSON-able dict)."""

    def __init__(
        self,
        workload: Workload,
        repetitions: int = 0,
        run_dir: Path | None = None,
        console: Console | None = None,
    ) -> None:
        self.w = workload
        self.rounds = repetitions or workload.repetitions
        self.run_dir = run_dir
        self.console = console or Console(stderr=True)
        self.requests = self._requests()
        self.n = len(self.requests)
        if self.n == 0:
            raise BenchError("the submit-rate workload plans no requests (a burst's count)")
        self.list_keys = list_keys(workload.modalities)
        self.notes: list[str] = []
        self._cmds: dict[str, dict[str, int]] = {}  # path -> summed command deltas

    def _requests(self) -> list[SubmitRequest]:
        """The workload's open-loop requests (its burst), inputs from the real sources."""
        names = {m.source for p in self.w.phases for m in p.mix}
        catalog = InputCatalog(self.w.sources, names)
        plan = open_schedule(self.w, {s: catalog.modality(s) for s in names})
        return [
            SubmitRequest(p.modality, catalog.get(p.source, p.input_index), p.priority, p.timeout_s)
            for p in plan
        ]

    # -- whole run ------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Start Redis, measure every path, start a text worker for the waited path, stop.

        Raises:
            BenchError: Redis or the worker did not start, or a path lost messages/results.
        """
        from producer.tools.bench.runner import bench_stack

        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        run_dir = self.run_dir or (REPO / ".run" / "bench" / f"{self.w.name}-{stamp}")
        started = datetime.now(UTC).isoformat()
        load_start = os.getloadavg()
        t_start = time.monotonic()
        with bench_stack(self.w, run_dir, self._step) as (settings, stack):
            body = self._measure(stack, settings)
        return self._report(body, started, run_dir, load_start, time.monotonic() - t_start)

    @contextlib.contextmanager
    def _step(self, what: str) -> Iterator[None]:
        t0 = time.monotonic()
        self.console.print(f"{what} ...")
        yield
        self.console.print(f"{what}: done in {time.monotonic() - t0:.1f} s")

    def _measure(self, stack: Any, settings: Settings) -> dict[str, Any]:
        from shared.redis_client import redis_client

        client = FleetClient(settings)
        admin = redis_client(settings)  # INFO, LLEN, DEL: the harness's, not the paths'
        raw_conn = redis_client(settings, "producer")
        raw_conn.ping()  # connected (HELLO, CLIENT SETINFO) before any path's window
        try:
            messages = self._capture(client, admin)
            sizes = sorted(len(m) for _, m in messages)
            rounds: dict[str, list[dict[str, Any]]] = {p: [] for p in SEND_PATHS}
            for r in range(self.rounds):
                k = r % len(SEND_PATHS)  # rotating order: drift falls on every path alike
                order = SEND_PATHS[k:] + SEND_PATHS[:k]
                for path in order:
                    send = self._sender(path, client, raw_conn, messages)
                    rounds[path].append(self._timed(path, send, admin))
                self.console.print(
                    f"round {r + 1}/{self.rounds}: "
                    + ", ".join(f"{p} {rounds[p][-1]['rps']:,.0f}/s" for p in SEND_PATHS)
                )
            with self._step("starting a text worker (batch mode)"):
                stack.start_worker("text", "batch")
            waited = self._waited_rounds(client, admin)
        finally:
            client.close()
            raw_conn.close()
            admin.close()
        paths = {p: summarize_path(rounds[p]) for p in SEND_PATHS}
        paths["submit_many+wait"] = summarize_path(waited)
        done = self.rounds * self.n
        return {
            "requests": self.n,
            "chunk": CHUNK,
            "message_bytes": sizes[len(sizes) // 2],
            "message_bytes_range": [sizes[0], sizes[-1]],
            "list_keys": sorted({k for k, _ in messages}),
            "paths": paths,
            "ratios": ratios(paths),
            "commands_per_request": {
                p: per_request(d, done, HARNESS_COMMANDS) for p, d in self._cmds.items()
            },
        }

    # -- the send paths -------------------------------------------------------------------
    def _capture(self, client: FleetClient, admin: Any) -> list[Message]:
        """Send the N requests once through ``submit_many`` and read back what it pushed."""
        with self._step(f"capture pass: {self.n} requests through submit_many"):
            return capture_messages(client, admin, self.requests, self.list_keys)

    def _sender(
        self, path: str, client: FleetClient, raw_conn: Any, messages: list[Message]
    ) -> Callable[[], None]:
        """A function that sends the N requests along ``path`` (built before the clock)."""
        reqs = self.requests
        if path == "raw":
            copies = [(k, fresh_copy(m)) for k, m in messages]

            def raw() -> None:
                for i in range(0, len(copies), CHUNK):
                    pipe = raw_conn.pipeline(transaction=False)
                    for key, msg in copies[i : i + CHUNK]:
                        pipe.lpush(key, msg)
                    pipe.execute()

            return raw
        if path == "submit_many":

            def many() -> None:
                for i in range(0, len(reqs), CHUNK):
                    client.submit_many(reqs[i : i + CHUNK])

            return many

        def one_by_one() -> None:
            for r in reqs:
                client.submit(r.modality, r.inputs, r.priority, r.timeout_s)

        return one_by_one

    def _timed(self, path: str, send: Callable[[], None], admin: Any) -> dict[str, Any]:
        """Run ``send`` once: its rate, CPU per request and what it enqueued.

        Raises:
            BenchError: the lists hold another number of messages than N.
        """
        before = _calls(admin)
        cpu0, t0 = time.process_time(), time.perf_counter()
        send()
        dt, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        self._add_calls(path, counter_delta(before, _calls(admin)))
        enqueued = self._drain(admin)
        if enqueued != self.n:
            raise BenchError(f"{path}: {enqueued} of {self.n} messages reached Redis")
        return {
            "rps": round(rate(self.n, dt), 1),
            "s": round(dt, 4),
            "cpu_us_per_request": round(cpu / self.n * 1e6, 1),
            "enqueued": enqueued,
        }

    def _add_calls(self, path: str, delta: dict[str, int]) -> None:
        acc = self._cmds.setdefault(path, {})
        for k, v in delta.items():
            acc[k] = acc.get(k, 0) + v

    def _drain(self, admin: Any) -> int:
        """Sum the lists' lengths, then delete them: how many messages they held."""
        pipe = admin.pipeline(transaction=False)
        for k in self.list_keys:
            pipe.llen(k)
        total = sum(int(n) for n in pipe.execute())
        admin.delete(*self.list_keys)
        return total

    # -- with a worker --------------------------------------------------------------------
    def _waited_rounds(self, client: FleetClient, admin: Any) -> list[dict[str, Any]]:
        """``submit_many`` + ``wait_all`` per round, a text worker consuming.

        Raises:
            BenchError: a request had no result within the workload's ``drain_timeout_s``.
        """
        for r in self.requests[:WARM_REQUESTS]:  # the worker's connections and caches warm
            client.submit(r.modality, r.inputs, r.priority, r.timeout_s).get(timeout_s=120)
        out = []
        for r in range(self.rounds):
            out.append(self._waited(client, admin))
            self.console.print(
                f"waited round {r + 1}/{self.rounds}: {out[-1]['rps']:,.1f} requests/s end to end"
            )
        return out

    def _waited(self, client: FleetClient, admin: Any) -> dict[str, Any]:
        before = _calls(admin)
        cpu0, wall0, t0 = time.process_time(), time.time(), time.perf_counter()
        handles = []
        for i in range(0, self.n, CHUNK):
            handles += client.submit_many(self.requests[i : i + CHUNK])
        t_sent = time.perf_counter()
        outs = client.wait_all(handles, timeout_s=self.w.drain_timeout_s, interval_s=0.1)
        t_end, cpu = time.perf_counter(), time.process_time() - cpu0
        self._add_calls("submit_many+wait", counter_delta(before, _calls(admin)))
        arrived = [o for o in outs if o is not None]
        if len(arrived) != self.n:
            raise BenchError(
                f"submit_many+wait: {len(arrived)} of {self.n} results within "
                f"{self.w.drain_timeout_s:.0f} s"
            )
        last_ms = max(o.get("done_ms") or 0.0 for o in arrived)
        # date_done is the worker's wall clock (same machine); without one, when wait_all saw it
        span = last_ms / 1000.0 - wall0 if last_ms > wall0 * 1000.0 else t_end - t0
        errors: dict[str, int] = {}
        for o in arrived:
            if "error" in o:
                errors[o["error"]["code"]] = errors.get(o["error"]["code"], 0) + 1
        return {
            "rps": round(rate(self.n, span), 1),
            "s": round(span, 3),
            "wall_s": round(t_end - t0, 3),
            "submit_rps": round(rate(self.n, t_sent - t0), 1),
            "cpu_us_per_request": round(cpu / self.n * 1e6, 1),
            "results": len(arrived),
            "ok": len(arrived) - sum(errors.values()),
            "errors": errors,
        }

    # -- report ---------------------------------------------------------------------------
    def _report(
        self,
        body: dict[str, Any],
        started: str,
        run_dir: Path,
        load_start: tuple[float, ...],
        duration_s: float,
    ) -> dict[str, Any]:
        from producer.tools.bench.report import report_head
        from producer.tools.bench.transport_report import busy_warnings, machine_facts

        body["verdict"] = verdict(body["ratios"]["submit_many_over_raw"])
        if self.rounds < 3:
            self.notes.append(f"{self.rounds} round(s): medians need at least 3")
        return {
            **report_head(self.w, started, duration_s),
            "repetitions": self.rounds,
            "run_dir": str(run_dir),
            "machine": machine_facts(load_start, os.getloadavg()),
            "method": dict(METHOD),
            "submit_rate": body,
            "warnings": [*self.notes, *busy_warnings(load_start)],
        }


def run_submit_rate(
    w: Workload, repetitions: int, out_dir: Path, run_dir: Path | None, err: Console
) -> int:
    """``fleet bench submit-rate``: run, write ``reports/bench`` files, print; exit status."""
    from producer.tools.bench.report import run_reported

    bench = SubmitRateBench(w, repetitions, run_dir, console=err)
    return run_reported(bench.run, print_submit_rate_report, out_dir, err)

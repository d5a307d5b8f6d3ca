"""``fleet bench WORKLOAD``: fleet, plain-Celery baseline and in-process limit, in one run.

Sequence (one invocation, one machine, one set of inputs):

1. A Redis of its own: a fresh run directory under ``.run/bench/``, free loopback ports,
   set as ``FLEET_*`` variables before any settings are built (workers inherit them); the
   workload's ``overrides`` are applied the same way, to every mode.
2. ``fleet``: one worker per modality the workload uses, in batch mode (the product as
   configured). As each worker reports ready (answers a Celery ping, after its model loaded
   and warmed) one request is sent at once: the cold first request. Five more, one at a
   time, give the warm idle latency. Then the repetitions, each the same schedule.
3. ``baseline``: workers stopped, Redis flushed, the same workers restarted in baseline mode
   (plain Celery: one task per message, prefetch 1, same model, process count and threads),
   every message sent at one Celery priority (FIFO). Same probes, same repetitions.
4. ``limit``: workers stopped; ``producer.tools.bench.limit`` in a subprocess on the inputs the
   measured requests used.
5. Everything stopped (Redis last), the report written.

With several modes the repetitions are interleaved by default (``producer.tools.bench.order``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from producer.client import FleetClient
from producer.stack.local import isolated_environment
from producer.stack.ports import parse_replicas
from producer.tools.bench.accounting import (
    Accountant,
    WindowSampler,
    completed_between,
    idle_window,
    load_window,
)
from producer.tools.bench.collector import EventTap, ResultCollector
from producer.tools.bench.generator import ClosedLoop, OpenLoop, Sender
from producer.tools.bench.limit_run import limit_into, used_sources
from producer.tools.bench.order import available_modes, run_interleaved
from producer.tools.bench.peers import PEER_MODES, PeerProcess, start_peer
from producer.tools.bench.records import NO_RESULT, Record, RecordTable, Timebase
from producer.tools.bench.results import MODES, BenchError, BenchOptions, BenchResult, ModeResult
from producer.tools.bench.schedule import ClosedPicker, Planned, open_schedule
from producer.tools.bench.sources import InputCatalog
from producer.tools.bench.stats import combine_lag, combine_reps, summarize_rep
from producer.tools.bench.workerstats import add_stats_diff, fleet_stats, settings_facts
from producer.tools.bench.workload import REPO, Workload
from shared.redis_client import redis_client
from shared.settings import Settings

log = logging.getLogger("fleet.bench")
# gateway: the fleet through `fleet gateway` (bench/gateway.py); peers: bench/peers/;
# redis-limit: one Redis's push/pop floor for the same bytes (bench/redislimit.py)
ALL_MODES = (*MODES, "gateway", *PEER_MODES, "redis-limit")
SERVICE_MODES = {"fleet": "batch", "baseline": "baseline", "gateway": "batch"}
WARM_PROBES = 5
PROBE_TIMEOUT_S = 120.0
EVENT_GRACE_S = 3.0  # task-succeeded follows the stored result; wait this long at most


@contextlib.contextmanager
def bench_environment(workload: Workload, run_dir: Path) -> Iterator[Settings]:
    """The bench's own stack environment plus the workload's ``FLEET_*`` overrides, with a
    /dev/shm root of its own (removed afterwards: the default root is a user's stack's)."""
    shm_root = Path(f"/dev/shm/mmfleet-{os.getuid()}-benchrun-{os.getpid()}")
    env = {"FLEET_TRANSPORT__SHM_ROOT": str(shm_root), **workload.env_overrides()}
    try:
        with isolated_environment(run_dir, env) as settings:
            yield settings
    finally:
        shutil.rmtree(shm_root, ignore_errors=True)


@contextlib.contextmanager
def bench_stack(
    workload: Workload, run_dir: Path, step: Callable[[str], contextlib.AbstractContextManager[Any]]
) -> Iterator[tuple[Settings, Any]]:
    """A bench runner's own stack: :func:`bench_environment`, a prepared ``Stack`` with Redis
    started (each step shown through ``step``), stopped afterwards with Redis's data removed.
    Yields ``(settings, stack)``.

    Raises:
        BenchError: Redis or a process the body started did not start (``StackError``).
    """
    from producer.stack.local import Stack, StackError

    with bench_environment(workload, run_dir) as settings:
        stack = Stack(settings)
        stack.prepare()
        try:
            with step("starting Redis"):
                stack.start_redis()
            yield settings, stack
        except StackError as exc:
            raise BenchError(str(exc)) from None
        finally:
            with step("stopping the stack"):
                stack.down()
            shutil.rmtree(run_dir / "redis", ignore_errors=True)


class Bench:
    """Runs one workload in every requested mode. See the module docstring."""

    def __init__(self, opts: BenchOptions, console: Console | None = None) -> None:
        self.opts = opts
        self.w = opts.workload
        self.reps = opts.repetitions or self.w.repetitions
        self.console = console or Console(stderr=True)
        self.catalog = InputCatalog(
            self.w.sources, {m.source for p in self.w.phases for m in p.mix}
        )
        self.tb = Timebase()
        self.modalities = self.w.modalities
        self._closers: list[Callable[[], None]] = []  # the HTTP senders of a repetition
        self._peers: dict[str, PeerProcess] = {}  # a peer mode's processes, by modality
        self._mode = ""
        self._clock_notes: list[str] = []  # wall-clock steps seen during repetitions
        self.workers = worker_counts(self.w, os.environ.get("FLEET_BENCH_WORKERS", ""))
        self.accounting = self.w.accounting_idle_s > 0
        self._acct: Accountant | None = None
        self._idle: dict[str, Any] | None = None  # this worker start's background rates
        self._windows: list[dict[str, Any]] = []  # this start's repetitions' windows
        self._redis_limit: Any = None

    # -- whole run ------------------------------------------------------------------------
    def run(self) -> BenchResult:
        """Run every mode; the stack is always stopped again, even on errors or Ctrl-C.

        Raises:
            BenchError: a worker or Redis did not start, or a mode failed.
        """
        from producer.stack.local import Stack, StackError

        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        run_dir = self.opts.run_dir or (REPO / ".run" / "bench" / f"{self.w.name}-{stamp}")
        res = BenchResult(self.w, self.reps, datetime.now(UTC).isoformat(), run_dir=str(run_dir))
        res.workers = {m: self.workers.get(m, 1) for m in self.modalities}
        res.load_avg_start = os.getloadavg()
        t_start = time.monotonic()
        with bench_environment(self.w, run_dir) as settings:
            stack = Stack(settings)
            stack.prepare()
            res.settings_facts = settings_facts(settings, self.modalities)
            try:
                stack.start_redis()
                self._run_modes(stack, settings, res)
            except StackError as exc:
                raise BenchError(str(exc)) from None
            finally:
                stack.down()
                shutil.rmtree(run_dir / "redis", ignore_errors=True)
        res.notes.extend(self._clock_notes)
        res.finished_utc = datetime.now(UTC).isoformat()
        res.duration_s = time.monotonic() - t_start
        res.load_avg_end = os.getloadavg()
        return res

    def _run_modes(self, stack: Any, settings: Settings, res: BenchResult) -> None:
        """The requested modes on the started Redis, interleaved (``BenchOptions``) or not."""
        wanted = tuple(m for m in self.opts.modes if m not in self.w.skip_modes)
        modes, skipped = available_modes(wanted)
        skipped += [f"{m}: {why}" for m, why in self.w.skip_modes.items() if m in self.opts.modes]
        for why in skipped:  # an optional extra: skipped with the reason, never failed
            self.console.print(f"[yellow]skipped[/yellow] {why}")
            res.notes.append(f"skipped {why}")
        runs = [*modes, *(m for m in ("limit", "redis-limit") if m in wanted)]
        if self.opts.interleave and len(runs) > 1 and self.reps > 1:
            run_interleaved(
                runs,
                self.reps,
                res,
                lambda mode, rep, first: self._service_mode(
                    mode, stack, settings, res, reps=[rep], first=first
                ),
                lambda rep: self._limit(res, stack, rep),
                self.console.print,
                others={
                    "redis-limit": lambda rep: self._redis_limit_rep(res, stack, settings, rep)
                },
            )
            return
        for mode in modes:
            res.modes[mode] = self._service_mode(mode, stack, settings, res)
        if "limit" in wanted:
            self._limit(res, stack)
        if "redis-limit" in wanted:
            for rep in range(self.reps):
                self._redis_limit_rep(res, stack, settings, rep)

    # -- fleet and baseline ---------------------------------------------------------------
    def _service_mode(
        self,
        mode: str,
        stack: Any,
        settings: Settings,
        res: BenchResult,
        reps: list[int] | None = None,
        first: bool = True,
    ) -> ModeResult:
        """Start ``mode``'s workers, run repetitions ``reps`` (default: all), stop them;
        only the ``first`` start takes the idle probes (warm idle latency, gateway overhead)."""
        out = ModeResult(mode)
        client = FleetClient(settings, role="admin")  # it flushes the db between modes
        if not res.redis_version:
            res.redis_version = str(client.app.backend.client.info("server")["redis_version"])
        probe_table = RecordTable()
        collector = ResultCollector(client.app, probe_table)
        tap = EventTap(client.app, probe_table)
        collector.start()
        tap.start()
        fifo = settings.priorities["normal"].celery_priority if mode == "baseline" else None
        self._mode = mode
        try:
            if mode == "gateway":
                with self._spinner("gateway: starting fleet gateway"):
                    stack.start_gateway()
                self._gateway = (stack.gateway_url(), settings.gateway_token())
            self._start_workers(mode, stack, client, probe_table, out)
            if first:
                self._warm_probes(client, probe_table, out)
            if self.accounting:
                self._start_accounting(stack, settings, res, mode)
            if first and mode == "gateway" and "text" in self.modalities:
                from producer.tools.bench.gateway import measure_overhead

                texts = [self.catalog.get(s, i)["text"] for s, i in self._text_inputs()]
                out.gateway = measure_overhead(client, *self._gateway, texts)
            stats_before = self._stats(client)
            for m, s in stats_before.items():
                out.workers.setdefault(m, {})["runtime"] = s.get("runtime")
                out.workers[m]["model"] = s.get("model")
            self._repetitions(mode, client, collector, tap, out, fifo, reps)
            if self._acct is not None:
                res.accounting[mode]["windows"] += self._windows
            self._measured(mode, client)
            if tap.failed is not None:
                res.notes.append(f"{mode}: the event tap failed ({tap.failed}); no queue/compute")
        finally:
            tap.stop()
            collector.stop()
            if mode == "gateway":
                stack.stop("gateway")
            self._stop_workers(mode, stack)
            self._stop_accounting()
            with contextlib.suppress(Exception):
                client.app.backend.client.flushdb()
            client.app.close()
        return out

    # -- CPU and Redis per request (workloads with accounting_idle_s) ----------------------
    def _start_accounting(
        self, stack: Any, settings: Settings, res: BenchResult, mode: str
    ) -> None:
        """An accountant over this start's processes and the background of an idle window."""
        self._acct = Accountant(stack.pids, redis_client(settings))
        self._windows = []
        with self._spinner(f"{mode}: idle window ({self.w.accounting_idle_s:.0f} s)"):
            self._idle = idle_window(self._acct, self.w.accounting_idle_s)
        res.accounting.setdefault(mode, {"idle": [], "windows": []})["idle"].append(self._idle)

    def _stop_accounting(self) -> None:
        if self._acct is not None:
            with contextlib.suppress(Exception):
                self._acct.admin.close()
        self._acct, self._idle = None, None

    def _sampler(self, t0: float) -> WindowSampler | None:
        """The accounting window of a repetition starting at monotonic ``t0``, started."""
        if self._acct is None:
            return None
        start_s, end_s = load_window(self.w)
        sampler = WindowSampler(self._acct, t0 + start_s, t0 + end_s)
        sampler.start()
        return sampler

    def _account(self, sampler: WindowSampler | None, records: list[Record]) -> None:
        """The window's figures, divided by the successes completed inside it."""
        if sampler is None:
            return
        sampler.join()
        if sampler.error is not None or sampler.a is None or sampler.b is None:
            self._clock_notes.append(f"{self._mode}: CPU accounting failed: {sampler.error}")
            return
        n = completed_between(records, self.tb.wall_ms(sampler.a.t), self.tb.wall_ms(sampler.b.t))
        self._windows.append(sampler.figures(self._idle, completed=n))

    def _redis_limit_rep(self, res: BenchResult, stack: Any, settings: Settings, rep: int) -> None:
        """One repetition of the ``redis-limit`` mode (``redislimit.py``), no workers up."""
        from producer.tools.bench.redislimit import RedisLimit

        if res.redis_limit_error:
            return
        client = FleetClient(settings, role="admin")
        acct = Accountant(stack.pids, redis_client(settings))
        try:
            with self._spinner(f"redis-limit {rep + 1}/{self.reps}: LPUSH/RPOP pipelines"):
                if self._redis_limit is None:
                    self._redis_limit = RedisLimit(self.w, self.catalog, settings)
                rl = self._redis_limit
                rl.capture(client, acct.admin)
                idle = idle_window(acct, min(self.w.accounting_idle_s or 1.0, 2.0))
                rps, win = rl.repetition(acct, idle)
        except Exception as exc:
            res.redis_limit_error = f"redis-limit failed: {exc}"
            self.console.print(f"[red]{res.redis_limit_error}[/red]")
            return
        finally:
            client.app.close()
            acct.admin.close()
        self.console.print(f"redis-limit {rep + 1}/{self.reps}: {rps:,.0f} messages/s")
        for m in rl.modalities:
            res.redis_limit.setdefault(m, {"throughput_reps": []})["throughput_reps"].append(rps)
        acc = res.accounting.setdefault("redis-limit", {"idle": [], "windows": []})
        acc["idle"].append(idle)
        if win:
            acc["windows"].append(win)

    def _repetitions(
        self,
        mode: str,
        client: FleetClient,
        collector: ResultCollector,
        tap: EventTap,
        out: ModeResult,
        fifo: int | None,
        reps: list[int] | None = None,
    ) -> None:
        """The measured repetitions (``reps``, default all), each with a fresh record table
        and its stats diff."""
        for rep in range(self.reps) if reps is None else reps:
            self.tb.resync()
            table = RecordTable()
            collector.table = table
            tap.table = table
            before = self._stats(client)
            t0 = time.monotonic()
            records = self._repetition(mode, rep, client, table, collector, fifo)
            wall_s = time.monotonic() - t0
            if note := self.tb.step_note(f"{mode} repetition {rep + 1}"):
                self._clock_notes.append(note)
            after = self._stats(client)
            add_stats_diff(out, before, after, wall_s)
            out.reps.append(records)
            out.summaries.append(summarize_rep(records))
            out.leftovers += self._clean_queues(client)

    def _stop_workers(self, mode: str, stack: Any) -> None:
        """Stop this mode's workers, all at once."""
        with self._spinner(f"{mode}: stopping workers"):
            names = [self._process_name(mode, m) for m in self.modalities]
            if mode not in PEER_MODES:
                names += [
                    stack.worker_name(m, i)
                    for m in self.modalities
                    for i in range(1, self.workers.get(m, 1))
                ]
            stoppers = [threading.Thread(target=stack.stop, args=(n,)) for n in names]
            for t in stoppers:
                t.start()
            for t in stoppers:
                t.join()

    def _measured(self, mode: str, client: FleetClient) -> None:
        """After a mode's repetitions, its workers still up (``metricscost`` reads them)."""

    def _start_workers(
        self, mode: str, stack: Any, client: FleetClient, table: RecordTable, out: ModeResult
    ) -> None:
        """Start every modality's worker in parallel; probe each the moment it is ready."""
        errors: list[BaseException] = []

        def start(m: str) -> None:
            try:
                t0 = time.monotonic()
                if mode in PEER_MODES:
                    window = stack.s.modality(m).device.prefetch_multiplier
                    self._peers[m] = start_peer(stack, mode, m, window)
                else:
                    for i in range(self.workers.get(m, 1)):
                        stack.start_worker(m, SERVICE_MODES[mode], instance=i)
                ready_s = time.monotonic() - t0
                first = self._probe(client, table, m)
                if not first.ok:
                    raise BenchError(
                        f"{mode}: the {m} worker answered its ping but its first request "
                        f"failed ({first.code}); its log:\n"
                        f"{stack.log_tail(self._process_name(mode, m))}"
                    )
                out.cold[m] = {"ready_s": ready_s, "first_ms": first.e2e_ms}
            except BaseException as exc:
                errors.append(exc)

        with self._spinner(f"{mode}: starting {', '.join(self.modalities)} workers"):
            threads = [threading.Thread(target=start, args=(m,)) for m in self.modalities]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        if errors:
            raise errors[0]

    def _warm_probes(self, client: FleetClient, table: RecordTable, out: ModeResult) -> None:
        """Requests one at a time on an idle worker: latency and overhead without load."""
        for m in self.modalities:
            recs = [self._probe(client, table, m) for _ in range(WARM_PROBES)]
            self._wait_events(table)
            lat = [r.e2e_ms for r in recs if r.ok and r.e2e_ms is not None]
            over = [
                r.e2e_ms - r.compute_ms
                for r in recs
                if r.ok and r.e2e_ms is not None and r.compute_ms is not None
            ]
            out.cold[m]["warm_idle_ms"] = statistics.median(lat) if lat else None
            out.cold[m]["warm_idle_samples_ms"] = lat
            out.cold[m]["idle_overhead_ms"] = statistics.median(over) if over else None

    def _probe(self, client: FleetClient, table: RecordTable, modality: str) -> Record:
        """Send one normal request alone and wait for its outcome (NO_RESULT on timeout)."""
        source = next(
            m.source
            for p in self.w.phases
            for m in p.mix
            if self.catalog.modality(m.source) == modality
        )
        planned = Planned("probe", 0.0, source, modality, 0, "normal", None, False)
        sender = self._sender(client, table, -1, None)
        done = threading.Event()
        with client.app.producer_or_acquire() as producer:
            rec = sender.send(
                [(planned, time.monotonic())], producer, on_done=lambda _r: done.set()
            )[0]
        if not done.wait(PROBE_TIMEOUT_S):
            table.complete(rec.id, self.tb.now_ms(), False, NO_RESULT)
        return rec

    def _repetition(
        self,
        mode: str,
        rep: int,
        client: FleetClient,
        table: RecordTable,
        collector: ResultCollector,
        fifo: int | None,
    ) -> list[Record]:
        modality_of = {
            k: self.catalog.modality(k) for k in self.w.sources if k in used_sources(self.w)
        }
        plan = open_schedule(self.w, modality_of)
        t0 = time.monotonic() + 0.2
        stop = threading.Event()
        gens: list[OpenLoop | ClosedLoop] = []
        for phase in self.w.phases:
            # One sending thread (and connection) per phase: a burst being sent must not
            # hold up a stream scheduled beside it.
            part = [p for p in plan if p.phase == phase.name]
            if part:
                sender = self._sender(client, table, rep, fifo)
                gens.append(OpenLoop(sender, part, t0, stop))
        for phase in self.w.phases:
            if phase.arrival == "closed":
                picker = ClosedPicker(self.w, phase, modality_of)
                sender = self._sender(client, table, rep, fifo)
                gens.append(ClosedLoop(sender, picker, t0, stop))
        closed = any(p.arrival == "closed" for p in self.w.phases)
        total = None if closed else len(plan)
        sampler = self._sampler(t0)
        label = f"{mode} {rep + 1}/{self.reps}"
        try:
            with self._progress() as progress:
                task = progress.add_task(label, total=total, info="")
                for g in gens:
                    g.start()
                self._wait_generators(gens, table, progress, task)
                self._drain(table, progress, task)
        except KeyboardInterrupt:
            stop.set()
            raise
        while self._closers:
            self._closers.pop()()
        for g in gens:
            if g.error is not None:
                raise BenchError(f"{mode}: the generator failed: {g.error}")
        missing = table.pending_ids()
        if missing:
            collector.sweep(missing)
        now = self.tb.now_ms()
        for task_id in table.pending_ids():
            table.complete(task_id, now, False, NO_RESULT)
        self._wait_events(table)
        self._account(sampler, table.records())
        return table.records()

    def _sender(
        self, client: FleetClient, table: RecordTable, rep: int, fifo: int | None
    ) -> Sender:
        """The direct path's Sender, or in the gateway mode one that POSTs to the gateway."""
        if getattr(self, "_mode", "") == "gateway":
            from producer.tools.bench.gateway import GatewaySender

            url, token = self._gateway
            sender = GatewaySender(client, self.catalog, table, self.tb, rep, url=url, token=token)
            self._closers.append(sender.close)
            return sender
        if getattr(self, "_mode", "") == "ray-serve":
            from producer.tools.bench.peers.sender import RaySender

            urls = {m: p.url for m, p in self._peers.items() if p.url}
            ray = RaySender(client, self.catalog, table, self.tb, rep, urls=urls)
            self._closers.append(ray.close)
            return ray
        one_queue = self._mode == "celery-batches"
        return Sender(client, self.catalog, table, self.tb, rep, fifo, one_queue=one_queue)

    def _stats(self, client: FleetClient) -> dict[str, dict[str, Any]]:
        """The fleet workers' ``fleet_stats`` (peers have none: their workers are not ours)."""
        if self._mode in PEER_MODES:
            return {}
        return fleet_stats(client, sum(self.workers.get(m, 1) for m in self.modalities))

    def _process_name(self, mode: str, modality: str) -> str:
        """The stack's name of the process serving ``modality`` in ``mode`` (log, pidfile)."""
        return self._peers[modality].name if mode in PEER_MODES else f"worker-{modality}"

    def _text_inputs(self, n: int = 8) -> list[tuple[str, int]]:
        """(source, index) of the workload's first ``n`` plain texts (the overhead probes
        must succeed: a workload may also send edge cases that are refused, blank or with no
        token after normalisation): line sources first, then by name, so every run picks
        the same."""
        srcs = sorted(
            (k for k in used_sources(self.w) if self.catalog.modality(k) == "text"),
            key=lambda k: (self.w.sources[k].kind != "lines", k),
        )
        out = [
            (src, i)
            for src in srcs
            for i in range(self.catalog.size(src))
            if _plain(str(self.catalog.get(src, i).get("text", "")))
        ]
        return out[:n]

    def _wait_generators(
        self, gens: list[Any], table: RecordTable, progress: Progress, task: Any
    ) -> None:
        while any(g.is_alive() for g in gens):
            self._update(progress, task, table)
            time.sleep(0.1)

    def _drain(self, table: RecordTable, progress: Progress, task: Any) -> None:
        deadline = time.monotonic() + self.w.drain_timeout_s
        while table.done < len(table) and time.monotonic() < deadline:
            self._update(progress, task, table)
            time.sleep(0.05)
        self._update(progress, task, table)

    def _update(self, progress: Progress, task: Any, table: RecordTable) -> None:
        info = f"sent {len(table)} done {table.done} errors {table.errors}"
        progress.update(task, completed=table.done, info=info)

    def _wait_events(self, table: RecordTable) -> None:
        deadline = time.monotonic() + EVENT_GRACE_S
        while time.monotonic() < deadline:
            if all(r.compute_ms is not None for r in table.records() if r.ok):
                return
            time.sleep(0.05)

    def _clean_queues(self, client: FleetClient) -> int:
        """Purge what a repetition left in the queues (requests that got no result)."""
        left = sum(sum(client.queue_depth(m).values()) for m in self.modalities)
        if left:
            with contextlib.suppress(Exception):
                client.app.control.purge()
        time.sleep(0.5)  # let the workers settle between repetitions
        return left

    def _limit(self, res: BenchResult, stack: Any, rep: int | None = None) -> None:
        """The in-process limit: all repetitions, or an interleaved run's ``rep``."""
        with self._spinner("limit: in-process"):
            limit_into(res, self.w, self.catalog, self.reps, stack, rep)

    # -- progress -------------------------------------------------------------------------
    def _progress(self) -> Progress:
        return Progress(
            SpinnerColumn(),
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        )

    @contextlib.contextmanager
    def _spinner(self, what: str) -> Iterator[None]:
        t0 = time.monotonic()
        with self.console.status(what):
            yield
        self.console.print(f"{what}: done in {time.monotonic() - t0:.1f} s")


def worker_counts(w: Workload, spec: str = "") -> dict[str, int]:
    """Worker processes per modality: ``spec`` (``FLEET_BENCH_WORKERS``, ``"text=4"``) over
    the workload's ``workers``; 1 where neither names a modality.

    Raises:
        BenchError: ``spec`` is not a valid ``<modality>=<count>`` list.
    """
    try:
        return {**w.workers, **parse_replicas(spec)} if spec.strip() else dict(w.workers)
    except ValueError as exc:
        raise BenchError(f"FLEET_BENCH_WORKERS: {exc}") from None


def summarize_mode(mr: ModeResult, w: Workload) -> dict[str, Any]:
    """Combined statistics of a service mode (see :mod:`producer.tools.bench.stats`)."""
    arrivals = {p.name: p.arrival for p in w.phases}
    return {
        "modalities": combine_reps(mr.summaries),
        "lag": combine_lag(mr.summaries, arrivals),
    }


def _plain(text: str) -> bool:
    """An ordinary text: at least three ASCII letters or digits, at most 1,000 characters."""
    return len(text) <= 1000 and sum(c.isascii() and c.isalnum() for c in text) >= 3

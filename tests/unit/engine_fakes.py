"""Fakes for the engine's pure-logic unit tests: a model adapter and requests.

Only the model and the received requests are fake; the parts under test (admission,
poison accounting, execution) and their collaborators (circuit breaker, latency model,
device runtime on the CPU, metrics registry, tracing off) are the real ones. The real
stack (Redis, Celery workers, real models) is covered by tests/integration.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from shared.errors import ImageDecodeError, InvalidInput, TransientError
from shared.metrics import FleetMetrics
from shared.schema import TaskEnvelope
from shared.settings import DeviceConfig, Settings
from shared.tracing import Tracing
from workers.batching.admission import DECODE_SLOT, FINAL, BlameBook
from workers.batching.batcher import LatencyModel, Pending, Work
from workers.batching.completion import Done, EngineStats, Observers, Outcome, Posted
from workers.batching.execution import BatchRunner, CircuitBreaker, RetryPolicy
from workers.batching.inject import RequestInjector
from workers.models.base import ModelAdapter, Prepared
from workers.models.runtime import DeviceRuntime

MODALITY = "text"


@dataclass
class FakeReq:
    """What the engine's parts read of a received request."""

    id: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    delivery_info: dict[str, Any] = field(default_factory=lambda: {"routing_key": "fleet.text"})


class Doubler(ModelAdapter):
    """Returns ``{"y": 2 * x}`` per sample; inputs are ``{"x": <int or a fault word>}``.

    Fault words (by sample value):
        ``"poison"``: the whole batch raises ``RuntimeError`` (a model fault);
        ``"bad"``: the whole batch raises ``InvalidInput`` (keeps its code);
        ``"huge"``: out of memory even alone;
        ``"flaky"``: ``TransientError`` on its first ``flaky_failures`` runs;
        ``"undecodable"``: ``preprocess`` raises ``ImageDecodeError``;
        ``"garbled"``: ``preprocess`` raises ``ValueError``.
    With ``capacity``, a batch of more samples runs out of memory.
    """

    modality = MODALITY

    def __init__(self, capacity: int | None = None, flaky_failures: int = 0) -> None:
        super().__init__(cfg=None, settings=None, runtime=None)  # type: ignore[arg-type]
        self.capacity = capacity
        self.flaky_failures = flaky_failures
        self.flaky_runs = 0
        self.calls: list[list[Any]] = []  # the samples of every run_batch call
        self.prepared = Counter[str]()

    def load(self) -> None:
        pass

    def example_inputs(self, batch_size: int, bucket: str | None = None) -> list[dict[str, Any]]:
        return [{"x": 1}] * batch_size

    def prepare(self, inputs: dict[str, Any]) -> Prepared:
        if "x" not in inputs:
            raise InvalidInput("missing 'x'")
        return Prepared(bucket="b", length=1, nbytes=8, payload=inputs["x"])

    def preprocess(self, prepared: Prepared) -> Any:
        if prepared.payload == "undecodable":
            raise ImageDecodeError("not an image")
        if prepared.payload == "garbled":
            raise ValueError("cannot parse")
        return prepared.payload

    def run_batch(self, samples: list[Any]) -> list[dict[str, Any]]:
        self.calls.append(list(samples))
        if "poison" in samples:
            raise RuntimeError("index 7 is out of bounds")
        if "bad" in samples:
            raise InvalidInput("token id out of vocabulary")
        if "huge" in samples or (self.capacity and len(samples) > self.capacity):
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if "flaky" in samples:
            self.flaky_runs += 1
            if self.flaky_runs <= self.flaky_failures:
                raise TransientError("device busy")
            return [{"y": "ok"} if s == "flaky" else {"y": 2 * s} for s in samples]
        return [{"y": 2 * s} for s in samples]


def envelope(x: Any, priority: str = "normal", **extra: Any) -> TaskEnvelope:
    return TaskEnvelope(modality=MODALITY, priority=priority, inputs={"x": x}, **extra)


def work(rid: str, x: Any, adapter: ModelAdapter) -> Work:
    env = envelope(x)
    return Work(FakeReq(rid), env, adapter.prepare(env.inputs), arrival_s=0.0)


class Clock:
    """A monotonic clock the test moves by hand (seconds)."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Host:
    """The engine's side of a runner: records what it posts and schedules."""

    def __init__(self, gate: Callable[[list[Work]], list[Work]] | None = None) -> None:
        self.posted: list[Posted] = []
        self.scheduled: list[Pending] = []
        self._gate = gate or (lambda batch: batch)
        self._seq = itertools.count(1)

    def post(self, items: Sequence[Posted]) -> None:
        self.posted.extend(items)

    def schedule(self, pending: Pending) -> None:
        self.scheduled.append(pending)

    def gate(self, batch: list[Work]) -> list[Work]:
        return self._gate(batch)

    def new_batch_id(self) -> str:
        return f"test-{next(self._seq)}"


@dataclass
class Rig:
    """A BatchRunner and what it handed on."""

    runner: BatchRunner
    adapter: Doubler
    breaker: CircuitBreaker
    clock: Clock
    stats: EngineStats
    host: Host

    @property
    def posted(self) -> list[Posted]:
        return self.host.posted

    @property
    def scheduled(self) -> list[Pending]:
        return self.host.scheduled


def finals(r: Rig) -> dict[str, Outcome]:
    """The final outcome of each request posted so far, by task id."""
    return {i.req.id: i.outcome for i in r.posted if isinstance(i, Done)}


def codes(r: Rig) -> dict[str, str]:
    return {tid: (o.error.code if o.error else "ok") for tid, o in finals(r).items()}


def rig(
    adapter: Doubler,
    *,
    max_retries: int = 2,
    backoff_s: float = 0.5,
    breaker: CircuitBreaker | None = None,
    gate: Callable[[list[Work]], list[Work]] | None = None,
    settled: Callable[[float], bool] | None = None,
) -> Rig:
    clock, stats, host = Clock(), EngineStats(), Host(gate)
    breaker = breaker or CircuitBreaker(threshold=5, cooldown_s=10.0)
    obs = Observers(stats, FleetMetrics(MODALITY), Tracing(Settings(), MODALITY))
    runner = BatchRunner(
        MODALITY,
        adapter,
        DeviceRuntime(DeviceConfig()),
        host,
        obs,
        breaker=breaker,
        retry=RetryPolicy(max_retries, backoff_s),
        latency=LatencyModel(),
        faults=RequestInjector(False),
        settled=settled or (lambda timeout_s: True),
        clock=clock,
    )
    return Rig(runner, adapter, breaker, clock, stats, host)


class MemoryCounters:
    """Blame records in a dict, with ``workers.batching.admission.InFlight``'s semantics
    (its Lua scripts and Redis round trips are covered by the integration tests). It plays one
    worker process incarnation at a time: :meth:`die` starts the next one, and the dead one's
    records stay, as they do in Redis until their TTL passes."""

    def __init__(self) -> None:
        self.records: dict[tuple[str, str], list[str]] = {}  # (incarnation, slot) -> ids
        self.final: set[str] = set()  # ids whose final result is stored
        self.down = False  # Redis unreachable
        self._incarnations = itertools.count(1)
        self.die()

    def die(self) -> None:
        """This incarnation dies (its records stay); the next one starts."""
        self.book = BlameBook(f"w{next(self._incarnations)}", ttl_s=3600)

    def _up(self) -> None:
        if self.down:
            raise ConnectionError("Redis is unreachable")

    def _write(self, slot: str, task_ids: Sequence[str]) -> None:
        self._up()
        self.book.put(slot, task_ids)
        self.records[(self.book.incarnation, slot)] = list(task_ids)

    def deaths(self, task_id: str) -> int:
        """The other incarnations whose records name ``task_id``."""
        me = self.book.incarnation
        return len({inc for (inc, _), ids in self.records.items() if inc != me and task_id in ids})

    def named(self, task_id: str) -> int:
        """How many records name ``task_id``."""
        return sum(task_id in ids for ids in self.records.values())

    def arrive(
        self, task_ids: Sequence[str], redelivered: Sequence[bool] | None = None
    ) -> list[int]:
        self._write(DECODE_SLOT, task_ids)
        flags = [True] * len(task_ids) if redelivered is None else redelivered
        return [1 + self.deaths(t) if r else 1 for t, r in zip(task_ids, flags, strict=True)]

    def begin(self, task_ids: Sequence[str]) -> list[int]:
        self._up()
        out = [FINAL if tid in self.final else 1 for tid in task_ids]
        self._write(self.book.lane(), [t for t, st in zip(task_ids, out, strict=True) if st > 0])
        return out

    def uncount(self, task_ids: Sequence[str]) -> None:
        self._up()
        for slot, ids in self.book.remove(task_ids).items():
            self._write(slot, ids)

    def retire(self) -> None:
        self._up()
        for slot in self.book.retire():
            self.records.pop((self.book.incarnation, slot), None)

    def store_final(self, task_id: str) -> None:
        """The final result is written: the marker set (records are not touched)."""
        self.final.add(task_id)

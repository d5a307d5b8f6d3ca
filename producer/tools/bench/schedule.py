"""The send schedule: pure functions, no I/O, deterministic for a seed.

Open-loop phases (``poisson``, ``burst``) are planned in full before a repetition starts:
each request gets its scheduled send time (``offset_s`` after the repetition's start), its
mix entry and its input. The generator then sends each request at that time, whatever
happened to earlier ones, and latency is measured from the scheduled time, so a slow
system cannot slow the load down and hide its own queueing (no coordinated omission).

Closed-loop phases cannot be planned in time (a slot frees when a result arrives); their mix
and inputs come from :class:`ClosedPicker`, equally deterministic in order.

Mix: a phase of ``n`` planned requests gets each entry's exact share (largest remainder),
shuffled with the seed, so a small run still covers every entry in proportion.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from producer.tools.bench.workload import MixEntry, Phase, Workload


@dataclass(frozen=True, slots=True)
class Planned:
    """One request to send.

    Attributes:
        phase: the phase's name.
        offset_s: scheduled send time, seconds after the repetition's start.
        source: the source name; ``modality`` is the source's.
        input_index: position in the source's input list (wraps around).
        priority: the class name.
        timeout_s: a per-request timeout, or ``None`` for the class default.
        measured: ``False`` while ``offset_s`` is inside the warmup.
    """

    phase: str
    offset_s: float
    source: str
    modality: str
    input_index: int
    priority: str
    timeout_s: float | None
    measured: bool


def poisson_offsets(
    rate_rps: float,
    rng: random.Random,
    count: int | None = None,
    duration_s: float | None = None,
) -> list[float]:
    """Arrival times of a Poisson process at ``rate_rps`` (exponential gaps), from 0.

    Stops after ``count`` arrivals or before ``duration_s`` seconds, whichever comes first.

    Raises:
        ValueError: neither ``count`` nor ``duration_s`` is given, or the rate is not positive.
    """
    if rate_rps <= 0:
        raise ValueError("rate_rps must be positive")
    if count is None and duration_s is None:
        raise ValueError("give count or duration_s")
    out: list[float] = []
    t = 0.0
    while count is None or len(out) < count:
        t += rng.expovariate(rate_rps)
        if duration_s is not None and t >= duration_s:
            break
        out.append(t)
    return out


def exact_shares(n: int, weights: Sequence[float]) -> list[int]:
    """Split ``n`` into integer shares proportional to ``weights`` (largest remainder).

    Raises:
        ValueError: no weights, or a weight that is not positive.
    """
    if not weights or any(w <= 0 for w in weights):
        raise ValueError("weights must be positive and non-empty")
    total = float(sum(weights))
    raw = [n * w / total for w in weights]
    shares = [int(r) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: (raw[i] - shares[i], -i), reverse=True)
    for i in order[: n - sum(shares)]:
        shares[i] += 1
    return shares


def assign_mix(n: int, weights: Sequence[float], rng: random.Random) -> list[int]:
    """Mix entry index for each of ``n`` requests: exact shares, shuffled."""
    picks = [i for i, k in enumerate(exact_shares(n, weights)) for _ in range(k)]
    rng.shuffle(picks)
    return picks


class InputCursors:
    """Next input index per source: each source is walked in order, from 0."""

    def __init__(self) -> None:
        self._next: dict[str, int] = {}

    def take(self, source: str) -> int:
        i = self._next.get(source, 0)
        self._next[source] = i + 1
        return i


def phase_offsets(phase: Phase, rng: random.Random) -> list[float]:
    """Scheduled send times of an open-loop phase, relative to the repetition's start.

    Raises:
        ValueError: the phase is closed-loop.
    """
    if phase.arrival == "burst":
        return [phase.start_s] * int(phase.count or 0)
    if phase.arrival == "poisson":
        assert phase.rate_rps is not None
        offs = poisson_offsets(phase.rate_rps, rng, phase.count, phase.duration_s)
        return [phase.start_s + t for t in offs]
    raise ValueError(f"phase {phase.name!r} is closed-loop: it has no schedule")


def open_schedule(workload: Workload, sources_modality: dict[str, str]) -> list[Planned]:
    """Every open-loop request of one repetition, sorted by scheduled send time.

    The same workload and seed give the same schedule: every mode and every repetition
    replays it identically, so their differences are the system's, not the load's.
    """
    cursors = InputCursors()
    planned: list[Planned] = []
    for k, phase in enumerate(workload.phases):
        if phase.arrival == "closed":
            continue
        rng = random.Random(f"{workload.seed}:{k}:{phase.name}")
        offsets = phase_offsets(phase, rng)
        picks = assign_mix(len(offsets), [m.weight for m in phase.mix], rng)
        for off, pick in zip(offsets, picks, strict=True):
            planned.append(_plan(workload, phase, phase.mix[pick], off, cursors, sources_modality))
    planned.sort(key=lambda p: p.offset_s)  # stable: a burst keeps its order
    return planned


def _plan(
    workload: Workload,
    phase: Phase,
    entry: MixEntry,
    offset_s: float,
    cursors: InputCursors,
    sources_modality: dict[str, str],
) -> Planned:
    return Planned(
        phase=phase.name,
        offset_s=offset_s,
        source=entry.source,
        modality=sources_modality[entry.source],
        input_index=cursors.take(entry.source),
        priority=entry.priority,
        timeout_s=entry.timeout_s,
        measured=offset_s >= workload.warmup_s,
    )


class ClosedPicker:
    """Mix and inputs for a closed-loop phase, one request at a time (seeded, in order)."""

    def __init__(self, workload: Workload, phase: Phase, sources_modality: dict[str, str]):
        self.workload = workload
        self.phase = phase
        self.sources_modality = sources_modality
        k = workload.phases.index(phase)
        self.rng = random.Random(f"{workload.seed}:{k}:{phase.name}")
        self.weights = [m.weight for m in phase.mix]
        self.cursors = InputCursors()

    def next(self, offset_s: float) -> Planned:
        """The next request, to be sent ``offset_s`` after the repetition's start."""
        entry = self.rng.choices(self.phase.mix, weights=self.weights)[0]
        return _plan(
            self.workload, self.phase, entry, offset_s, self.cursors, self.sources_modality
        )

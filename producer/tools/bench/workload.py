"""Workload files: ``configs/workloads/<name>.toml``, validated on load.

A workload names its input **sources** (real data in the repo), one or more **phases** (an
arrival process, how many requests or for how long, and the mix of sources and priorities),
and how to measure (repetitions, warmup, the limit's batch sizes). Phases run concurrently,
each from its own ``start_s``; ``priority-burst`` uses that to put a steady stream on top of a
backlog. Example::

    name = "mixed"
    repetitions = 3
    warmup_s = 3.0              # requests scheduled in the first 3 s of a repetition: unmeasured

    [sources.text]
    kind = "lines"              # one request per line, in file order, lengths as they come
    modality = "text"
    path = "data/text/botchan_sentences.txt"

    [[phases]]
    name = "steady"
    arrival = "poisson"         # poisson (open loop) | burst (all at start_s) | closed
    rate_rps = 60.0
    duration_s = 20.0
    [[phases.mix]]
    source = "text"
    priority = "realtime"
    weight = 1.0

Units are in the names (``rate_rps``, ``duration_s``, ``sizes_bytes``). Unknown keys are errors.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from shared.settings import PRIORITY_NAMES

REPO = Path(__file__).resolve().parents[3]
WORKLOAD_DIR = REPO / "configs" / "workloads"
# Settings the bench itself owns (its own Redis, ports and run directory): not overridable.
_RESERVED_OVERRIDES = ("redis.", "stack.", "flower.")


class WorkloadError(ValueError):
    """A workload file is missing or invalid; the message names the file and the field."""


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SourceSpec(_Spec):
    """Where a modality's inputs come from.

    Kinds: ``lines`` (a text file, one request per non-blank line), ``jsonl`` (one request
    per line, the text in ``field``), ``images`` (image files under ``path`` matching
    ``pattern``, sorted by name), ``tensor`` (synthetic tensors of ``sizes_bytes``, sent to
    ``fleet.transport_probe`` by ``producer/tools/bench/transport.py`` instead of the request
    modes).
    """

    kind: Literal["lines", "jsonl", "images", "tensor"]
    modality: str
    path: str = ""  # relative to the repository root
    field: str = "text"
    pattern: str = "*"
    sizes_bytes: list[int] = Field(default_factory=list)

    @model_validator(mode="after")
    def _needs_path(self) -> SourceSpec:
        if self.kind != "tensor" and not self.path:
            raise ValueError(f"a {self.kind!r} source needs a path")
        if self.kind == "tensor" and not self.sizes_bytes:
            raise ValueError("a 'tensor' source needs sizes_bytes")
        return self

    def resolved_path(self) -> Path:
        p = Path(self.path)
        return p if p.is_absolute() else REPO / p


class MixEntry(_Spec):
    """A share of a phase's requests: from ``source``, at ``priority``, by ``weight``."""

    source: str
    priority: str
    weight: float = Field(default=1.0, gt=0.0)
    timeout_s: float | None = Field(default=None, gt=0.0)  # None: the class default

    @model_validator(mode="after")
    def _known_priority(self) -> MixEntry:
        if self.priority not in PRIORITY_NAMES:
            raise ValueError(f"priority {self.priority!r} is not one of {PRIORITY_NAMES}")
        return self


class Phase(_Spec):
    """One arrival process.

    - ``poisson``: open loop, exponential gaps at ``rate_rps``, for ``count`` requests or
      ``duration_s`` seconds. Send times are fixed in advance and never wait for results.
    - ``burst``: ``count`` requests all scheduled at ``start_s`` (a backlog).
    - ``closed``: ``concurrency`` requests in flight; each result frees a slot that is
      refilled at once, for ``count`` requests or ``duration_s`` seconds.
    """

    name: str
    arrival: Literal["poisson", "burst", "closed"]
    rate_rps: float | None = Field(default=None, gt=0.0)
    concurrency: int | None = Field(default=None, ge=1)
    count: int | None = Field(default=None, ge=1)
    duration_s: float | None = Field(default=None, gt=0.0)
    start_s: float = Field(default=0.0, ge=0.0)
    mix: list[MixEntry] = Field(min_length=1)
    tenant: str | None = None  # the tenant of the phase's requests (the tenant-fairness runner)

    @model_validator(mode="after")
    def _complete(self) -> Phase:
        need = {"poisson": "rate_rps", "closed": "concurrency"}.get(self.arrival)
        if need and getattr(self, need) is None:
            raise ValueError(f"a {self.arrival!r} phase needs {need}")
        if self.arrival == "burst" and self.count is None:
            raise ValueError("a 'burst' phase needs count")
        if self.arrival != "burst" and self.count is None and self.duration_s is None:
            raise ValueError(f"a {self.arrival!r} phase needs count or duration_s")
        return self


class LimitSpec(_Spec):
    """How the in-process limit is measured (see ``producer/tools/bench/limit.py``).

    ``batch_sizes`` per modality are the candidates swept (default: 1, the preferred sizes and
    the max batch size from the fleet config); ``sweep_inputs`` inputs per candidate; then the
    best size runs ``max_inputs`` of the workload's measured inputs once per repetition.
    """

    batch_sizes: dict[str, list[int]] = Field(default_factory=dict)
    sweep_inputs: int = Field(default=256, ge=1)
    max_inputs: int = Field(default=1000, ge=1)


class Workload(_Spec):
    """A whole workload file. See the module docstring."""

    name: str
    description: str = ""
    status: Literal["ready", "placeholder"] = "ready"
    skip_reason: str = ""
    # "submit-rate": producer/tools/bench/submitrate.py runs it (the producer's enqueue rate)
    # instead of the fleet/baseline/limit modes.
    # "tenant-fairness": producer/tools/bench/fairness.py (fair share vs FIFO between tenants).
    runner: Literal["modes", "submit-rate", "tenant-fairness"] = "modes"
    repetitions: int = Field(default=3, ge=1)
    seed: int = 0
    warmup_s: float = Field(default=0.0, ge=0.0)
    drain_timeout_s: float = Field(default=120.0, gt=0.0)
    overrides: dict[str, str | int | float | bool] = Field(default_factory=dict)
    sources: dict[str, SourceSpec] = Field(default_factory=dict)
    phases: list[Phase] = Field(default_factory=list)
    limit: LimitSpec = Field(default_factory=LimitSpec)
    # The modes run when ``--modes`` is left at its default (``fleet,baseline,limit``);
    # empty: that default.
    modes: list[str] = Field(default_factory=list)
    # Modes that mean nothing for this workload, with the reason (skipped and noted).
    skip_modes: dict[str, str] = Field(default_factory=dict)
    # Worker processes per modality for the fleet, baseline and gateway modes (default 1);
    # FLEET_BENCH_WORKERS="text=4" overrides it.
    workers: dict[str, int] = Field(default_factory=dict)
    # > 0: CPU per request by process and Redis per request (producer/tools/bench/accounting.py),
    # with an idle window of this many seconds per worker start for Redis's background.
    accounting_idle_s: float = Field(default=0.0, ge=0.0)

    @model_validator(mode="after")
    def _consistent(self) -> Workload:
        if self.status == "placeholder":
            if not self.skip_reason:
                raise ValueError("a placeholder workload needs a skip_reason")
            return self
        if not self.phases:
            raise ValueError("a workload needs at least one phase")
        names = [p.name for p in self.phases]
        if len(set(names)) != len(names):
            raise ValueError(f"phase names must be unique: {names}")
        for p in self.phases:
            for m in p.mix:
                if m.source not in self.sources:
                    raise ValueError(f"phase {p.name!r}: unknown source {m.source!r}")
        ends = [p.start_s + p.duration_s for p in self.phases if p.duration_s]
        if self.accounting_idle_s and (not ends or max(ends) <= self.warmup_s):
            raise ValueError("accounting_idle_s needs a phase with duration_s beyond warmup_s")
        if any(n < 1 for n in self.workers.values()):
            raise ValueError(f"workers: at least 1 per modality, got {self.workers}")
        for key in self.overrides:
            if key.startswith(_RESERVED_OVERRIDES):
                raise ValueError(f"override {key!r}: the bench owns redis, stack and flower")
        return self

    @property
    def runnable(self) -> bool:
        return self.status == "ready"

    @property
    def modalities(self) -> list[str]:
        """Modalities the phases send, in a stable order (text, image, video, xmodal)."""
        used = {self.sources[m.source].modality for p in self.phases for m in p.mix}
        order = ("text", "image", "video", "xmodal")
        return [m for m in order if m in used] + sorted(used - set(order))

    def env_overrides(self) -> dict[str, str]:
        """``overrides`` as ``FLEET_*`` environment variables (dots become ``__``)."""
        out: dict[str, str] = {}
        for key, value in self.overrides.items():
            text = str(value).lower() if isinstance(value, bool) else str(value)
            out["FLEET_" + key.upper().replace(".", "__")] = text
        return out


def workload_path(name_or_path: str) -> Path:
    """``configs/workloads/<name>.toml`` for a bare name, else the path as given."""
    p = Path(name_or_path)
    if p.suffix == ".toml" or p.parent != Path("."):
        return p
    return WORKLOAD_DIR / f"{name_or_path}.toml"


def load_workload(name_or_path: str) -> Workload:
    """Read and validate a workload.

    Raises:
        WorkloadError: the file does not exist, is not TOML, or does not match the schema.
    """
    path = workload_path(name_or_path)
    if not path.is_file():
        known = ", ".join(list_workloads()) or "none"
        raise WorkloadError(f"no workload {name_or_path!r} ({path}); known: {known}")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise WorkloadError(f"{path}: not valid TOML: {exc}") from None
    return parse_workload(data, origin=str(path))


def parse_workload(data: dict[str, object], origin: str = "<dict>") -> Workload:
    """Validate an already-parsed workload mapping.

    Raises:
        WorkloadError: it does not match the schema.
    """
    try:
        return Workload.model_validate(data)
    except ValidationError as exc:
        errs = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or '(top)'}: {e['msg']}" for e in exc.errors()[:5]
        )
        raise WorkloadError(f"{origin}: {errs}") from None


def list_workloads() -> list[str]:
    """Names of the workload files shipped in ``configs/workloads``."""
    return sorted(p.stem for p in WORKLOAD_DIR.glob("*.toml"))

"""Chaos scenarios as data: ``configs/chaos.toml`` (see its header for the fault kinds)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

FaultKind = Literal[
    "sigkill",
    "sigstop",
    "sigterm",
    "redis_restart",
    "client_kill",
    "duplicates",
    "malformed",
    "results_refused",
    "results_halfway",
    "video_sigkill",
    "gateway_sigkill",
    "clock_skew",
    "disk_full",
]
DEFAULT_FILE = Path(__file__).resolve().parents[3] / "configs" / "chaos.toml"


class LoadSpec(BaseModel):
    """Steady traffic during every scenario (rates in requests per second)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    text_per_s: float = Field(default=12.0, ge=0.0)
    image_per_s: float = Field(default=1.0, ge=0.0)
    video_every_s: float = Field(default=4.0, gt=0.0)
    warmup_s: float = Field(default=3.0, ge=0.0)
    settle_timeout_s: float = Field(default=90.0, gt=0.0)


class Scenario(BaseModel):
    """One fault. ``target`` names a process of the stack (``worker-text-1``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    fault: FaultKind
    target: str = "worker-text"
    times: int = Field(default=1, ge=1)
    interval_s: float = Field(default=5.0, ge=0.0)
    seconds: float = Field(default=5.0, ge=0.0)
    count: int = Field(default=20, ge=1)
    modality: Literal["text", "video"] = "text"  # video: needs the video worker
    short: bool = False  # part of `fleet chaos --short` (CI)
    # final states that miss the goal in this scenario (a coded failure is otherwise a
    # final result like any other): clock_skew's DEADLINE_EXCEEDED, say
    fail_states: list[str] = Field(default_factory=list)


class ChaosFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    load: LoadSpec = Field(default_factory=LoadSpec)
    scenarios: list[Scenario]


class ScenarioError(ValueError):
    """The scenario file is missing or invalid."""


def load_scenarios(path: Path = DEFAULT_FILE) -> ChaosFile:
    """Read and validate a chaos file.

    Raises:
        ScenarioError: unreadable, not TOML, or not the schema above.
    """
    try:
        data = tomllib.loads(path.read_text())
        return ChaosFile.model_validate(data)
    except (OSError, tomllib.TOMLDecodeError, ValidationError) as exc:
        raise ScenarioError(f"{path}: {exc}") from None


def select(cf: ChaosFile, names: list[str], short: bool, with_video: bool) -> list[Scenario]:
    """The scenarios to run: by name if given, else the short ones (or all); video
    scenarios only with a video worker.

    Raises:
        ScenarioError: a name that is not in the file.
    """
    known = {s.name for s in cf.scenarios}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ScenarioError(f"unknown scenarios {unknown}; known: {sorted(known)}")
    chosen = [s for s in cf.scenarios if (s.name in names if names else (s.short or not short))]
    return [s for s in chosen if with_video or s.modality != "video"]

"""Chaos scenarios as data: ``configs/chaos.toml`` (see its header for each fault's parameters;
the faults themselves are ``producer.tools.chaos.faults.FAULTS``)."""

from __future__ import annotations

import tomllib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from producer.tools.chaos.faults import FaultParams, fault_named
from producer.tools.chaos.load import LoadSpec

DEFAULT_FILE = Path(__file__).resolve().parents[3] / "configs" / "chaos.toml"


class Scenario(FaultParams):
    """One fault (a name of ``producer.tools.chaos.faults.FAULTS`` the chaos drill uses) and
    its parameters."""

    name: str
    fault: str
    short: bool = False  # part of `fleet chaos --short` (CI)
    # final states that miss the goal in this scenario (a coded failure is otherwise a
    # final result like any other): clock_skew's DEADLINE_EXCEEDED, say
    fail_states: list[str] = Field(default_factory=list)

    @field_validator("fault")
    @classmethod
    def _known_fault(cls, v: str) -> str:
        fault_named(v, "chaos")
        return v


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

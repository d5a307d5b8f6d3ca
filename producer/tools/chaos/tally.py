"""What a scenario did to its requests: the report row (pure logic, no I/O).

The row's keys are the report's contract (``reports/chaos.json``), read by operators' tools::

    {"name", "sent", "completed", "lost", "duplicated_results", "duplicated_executions",
     "recover_s", "worker_exited", ...}

- ``completed``: requests with a final result (SUCCESS or a coded FAILURE) by the end;
- ``lost``: sent and never final within the settle timeout;
- ``duplicated_results``: requests whose final result was published more than once, or
  changed after it was first read (a client could have seen two);
- ``duplicated_executions``: requests the workers finished running more than once (their
  one log line per finished request); harmless when ``duplicated_results`` is 0;
- ``recover_s``: seconds from the end of the fault until every request was final (``None``
  if some never were);
- ``unexpected_failures``: the fault's own probe requests (``Seen.probes``: sent with a
  deadline nothing but the fault could make them miss) whose final state is one the scenario
  names in ``fail_states``; the load's requests (0.2 s deadlines at REALTIME) may miss theirs
  on a busy machine.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Seen:
    """Everything observed during one scenario."""

    sent: list[str] = field(default_factory=list)  # task ids, in order (copies not repeated)
    first: dict[str, dict[str, Any]] = field(default_factory=dict)  # first final outcome read
    last: dict[str, dict[str, Any]] = field(default_factory=dict)  # final outcome at the end
    publishes: Counter[str] = field(default_factory=Counter)  # final-state publishes per id
    executions: Counter[str] = field(default_factory=Counter)  # finished runs per id
    fault_end_s: float = 0.0  # monotonic
    all_final_s: float | None = None  # monotonic; None: not all final in time
    worker_exited: bool = False  # a worker the scenario did not kill exited
    restart_s: list[float] = field(default_factory=list)  # worker restarts (supervisor)
    probes: list[str] = field(default_factory=list)  # task ids a fault sent to watch (also in sent)
    notes: dict[str, Any] = field(default_factory=dict)  # a fault's own figures, in its row


def state_of(outcome: Mapping[str, Any]) -> str:
    """``SUCCESS`` or the failure's code."""
    return "SUCCESS" if "result" in outcome else str(outcome.get("error", {}).get("code"))


def row(name: str, seen: Seen, fail_states: Collection[str] = ()) -> dict[str, Any]:
    """The report row of one scenario (``fail_states``: final states its probes must not
    end in)."""
    ids = list(dict.fromkeys(seen.sent))
    final = [i for i in ids if i in seen.last]
    changed = {
        i for i in final if i in seen.first and state_of(seen.first[i]) != state_of(seen.last[i])
    }
    published_twice = {i for i in ids if seen.publishes[i] > 1}
    recover = (
        round(max(seen.all_final_s - seen.fault_end_s, 0.0), 2)
        if seen.all_final_s is not None and len(final) == len(ids)
        else None
    )
    return {
        "name": name,
        "sent": len(ids),
        "completed": len(final),
        "lost": len(ids) - len(final),
        "duplicated_results": len(changed | published_twice),
        "duplicated_executions": sum(1 for i in ids if seen.executions[i] > 1),
        "recover_s": recover,
        "worker_exited": seen.worker_exited,
        "worker_restart_s": [round(s, 1) for s in seen.restart_s],
        "states": dict(Counter(state_of(seen.last[i]) for i in final).most_common()),
        "unexpected_failures": sum(
            1 for i in seen.probes if i in seen.last and state_of(seen.last[i]) in fail_states
        ),
        "lost_ids": [i for i in ids if i not in seen.last][:20],  # for reading the logs
        **seen.notes,
    }


def verdict(r: Mapping[str, Any], recover_limit_s: float) -> list[str]:
    """What a row misses of the goal: 0 lost, 0 duplicated results, every request final
    within ``recover_limit_s`` of the fault's end (worker restarts not counted), no exit."""
    misses = []
    if r["lost"]:
        misses.append(f"{r['lost']} lost")
    if r["duplicated_results"]:
        misses.append(f"{r['duplicated_results']} duplicated results")
    if r["recover_s"] is None or r["recover_s"] - sum(r["worker_restart_s"]) > recover_limit_s:
        misses.append(f"recover_s {r['recover_s']} > {recover_limit_s}")
    if r["worker_exited"]:
        misses.append("a worker exited")
    if r.get("unexpected_failures"):
        misses.append(f"{r['unexpected_failures']} probes in a state the fault must not cause")
    return misses

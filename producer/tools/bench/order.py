"""In which order a bench run measures its modes.

Sequential (the order before 2026-12-03): every repetition of one mode, then the next mode.
On a machine whose speed drifts by 5-15 % over minutes (this 2-core VM), a mode measured in
a slow phase then looks slower than one measured in a fast phase, and a ratio of two modes
measures the drift as much as the modes.

Interleaved (the default with several modes): repetition k of every mode before repetition
k + 1 of any, the order rotated by one mode per repetition, so each mode meets the early and
the late part of the run and each position in the order. The first repetition starts with
the first mode (the fleet, whose first repetition's inputs the limit replays).
"""

from __future__ import annotations

from collections.abc import Callable

from producer.tools.bench.peers import PEER_MODES, unavailable_reason
from producer.tools.bench.results import BenchResult, ModeResult, merge_mode

__all__ = ["SERVICE_ORDER", "available_modes", "rotation", "run_interleaved"]

LIMIT = "limit"
# Runs that start no workers: the in-process limit and one Redis's push/pop floor.
IN_PROCESS = (LIMIT, "redis-limit")
SERVICE_ORDER = ("fleet", "gateway", "baseline", *PEER_MODES)


def available_modes(requested: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """The requested service modes in :data:`SERVICE_ORDER`, and why each peer left out
    was (its optional extra is not installed: skipped, never failed)."""
    modes, skipped = [], []
    for mode in SERVICE_ORDER:
        if mode not in requested:
            continue
        reason = unavailable_reason(mode) if mode in PEER_MODES else None
        if reason:
            skipped.append(reason)
        else:
            modes.append(mode)
    return modes, skipped


def rotation(runs: list[str], rep: int) -> list[str]:
    """``runs`` rotated left by ``rep`` (repetition ``rep``, from 0, runs them in this order).

    Raises:
        ValueError: ``runs`` is empty.
    """
    if not runs:
        raise ValueError("no modes to order")
    k = rep % len(runs)
    return runs[k:] + runs[:k]


def run_interleaved(
    runs: list[str],
    reps: int,
    res: BenchResult,
    service: Callable[[str, int, bool], ModeResult],
    limit: Callable[[int], None],
    say: Callable[[str], None] = lambda _m: None,
    others: dict[str, Callable[[int], None]] | None = None,
) -> None:
    """Run ``reps`` repetitions of every mode in ``runs``, interleaved (module docstring).

    Args:
        runs: mode names in their base order; ``"limit"`` for the in-process limit.
        reps: repetitions per mode.
        res: receives ``order`` (each repetition's order) and ``modes`` (a mode's first
            start's result, later ones merged into it by :func:`merge_mode`).
        service: ``service(mode, rep, first)`` starts ``mode``'s workers, runs repetition
            ``rep`` and stops them; ``first`` on the mode's first start.
        limit: ``limit(rep)`` runs the limit's repetition ``rep`` into ``res.limit``.
        say: progress lines.
        others: other runs without workers by name (``redis-limit``): ``fn(rep)``.
    """
    for rep in range(reps):
        order = rotation(runs, rep)
        res.order.append(order)
        say(f"repetition {rep + 1}/{reps}: {', '.join(order)}")
        for mode in order:
            if mode == LIMIT:
                limit(rep)
                continue
            if others and mode in others:
                others[mode](rep)
                continue
            first = mode not in res.modes
            one = service(mode, rep, first)
            if first:
                res.modes[mode] = one
            else:
                merge_mode(res.modes[mode], one)

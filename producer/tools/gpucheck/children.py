"""Run a check's probe in fresh ``spawn`` processes, so CUDA never starts in the parent."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["CHECK_TIMEOUT_S", "CheckFailed", "run_in_children"]

CHECK_TIMEOUT_S = 90.0


class CheckFailed(AssertionError):
    """A check's condition does not hold (or a child process failed)."""


def _child_entry(q: Any, index: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        q.put((index, True, fn(*args)))
    except BaseException:
        q.put((index, False, traceback.format_exc()))


def run_in_children(
    fn: Callable[..., Any],
    args_list: Sequence[tuple[Any, ...]],
    timeout_s: float = CHECK_TIMEOUT_S,
) -> list[Any]:
    """Run ``fn(*args)`` for each ``args`` in its own spawned process, all at once.

    ``fn`` must be a module-level function and its arguments and result picklable.

    Returns:
        The results, in the order of ``args_list``.

    Raises:
        CheckFailed: a child raised (its traceback is in the message), died, or did not
            answer within ``timeout_s``.
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_child_entry, args=(q, i, fn, args), daemon=True)
        for i, args in enumerate(args_list)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < len(procs):
            left = deadline - time.monotonic()
            if left <= 0:
                raise CheckFailed(f"{fn.__name__}: no answer within {timeout_s:.0f} s")
            try:
                i, ok, payload = q.get(timeout=min(left, 0.5))
            except queue.Empty:
                for i, p in enumerate(procs):
                    if i not in results and p.exitcode not in (None, 0):
                        raise CheckFailed(
                            f"{fn.__name__}: child {i} died with exit code {p.exitcode}"
                        ) from None
                continue
            if not ok:
                raise CheckFailed(f"{fn.__name__}: child {i} raised:\n{payload}")
            results[i] = payload
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        q.close()
    return [results[i] for i in range(len(procs))]

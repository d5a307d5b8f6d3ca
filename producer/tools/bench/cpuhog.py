"""A CPU hog for stress runs: N processes, each busy ``duty`` of every 10 ms.

Emulates a slower, shared machine (a noisy neighbour) beside a bench run, e.g. the REALTIME
tail under contention (docs/measurements/, "REALTIME tail")::

    python -m producer.tools.bench.cpuhog --procs 2 --duty 0.3 --seconds 75 &
    fleet bench priority-burst --modes fleet

Busy-waits (no I/O, no memory traffic to speak of); stops after ``--seconds``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

PERIOD_S = 0.010


def _spin(duty: float, until: float) -> None:
    while time.monotonic() < until:
        t0 = time.perf_counter()
        busy_until = t0 + duty * PERIOD_S
        while time.perf_counter() < busy_until:
            pass
        time.sleep(max(0.0, PERIOD_S - (time.perf_counter() - t0)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, default=2, help="busy processes (default 2)")
    p.add_argument("--duty", type=float, default=0.3, help="busy share of each 10 ms, 0-1")
    p.add_argument("--seconds", type=float, default=75.0, help="how long (default 75)")
    args = p.parse_args(argv)
    if not 0.0 < args.duty <= 1.0 or args.procs < 1:
        p.error("--duty must be in (0, 1] and --procs >= 1")
    until = time.monotonic() + args.seconds
    procs = [mp.Process(target=_spin, args=(args.duty, until)) for _ in range(args.procs)]
    for pr in procs:
        pr.start()
    for pr in procs:
        pr.join()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``producer.tools.chaos.faketime``: a process whose wall clock really is an hour off while its
monotonic clock, its sleeps and its waits stay true (the skewed-clock test and drill rely on
it), and a clear reason where libfaketime or a compiler is missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from producer.tools.chaos import faketime
from producer.tools.chaos.faketime import FaketimeUnavailable, skewed_env, sweep

PROBE = """
import json, threading, time
w0, m0 = time.time(), time.monotonic()
time.sleep(0.2)  # Python 3.11: clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)
threading.Event().wait(0.1)  # a timed lock wait on the monotonic clock
print(json.dumps({"wall": w0, "mono": m0, "slept": time.monotonic() - m0}))
"""


def test_a_missing_libfaketime_is_named_with_its_package(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(faketime, "LIBFAKETIME_PATHS", ())
    monkeypatch.delenv("FLEET_LIBFAKETIME", raising=False)
    with pytest.raises(FaketimeUnavailable, match="apt-get install libfaketime"):
        skewed_env(3600, tmp_path)


@pytest.mark.parametrize("offset", [3600, -3600])
def test_only_the_wall_clock_moves_and_sleeps_still_work(offset: int, tmp_path: Path) -> None:
    try:
        env = {**os.environ, **skewed_env(offset, tmp_path)}
    except FaketimeUnavailable as exc:
        pytest.skip(f"cannot skew a process's clock: {exc}")
    assert env["FAKETIME"] == f"{offset:+d}" and env["FAKETIME_DONT_FAKE_MONOTONIC"] == "1"
    w0, m0 = time.time(), time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=30
    )
    sweep()  # libfaketime's segments of that process
    assert done.returncode == 0, done.stderr  # EINVAL from time.sleep without the shim
    seen = json.loads(done.stdout)
    assert abs((seen["wall"] - w0) - offset) < 5.0  # an hour off
    assert 0.0 <= seen["mono"] - m0 < 5.0  # the same monotonic clock as this process
    assert 0.25 <= seen["slept"] < 2.0  # slept and waited their time, not an hour


def test_sweep_removes_what_libfaketime_left_of_ended_processes(tmp_path: Path) -> None:
    """libfaketime 0.9.10 leaves ``faketime_shm_<pid>`` and ``sem.faketime_sem_<pid>`` in
    /dev/shm after every process it was preloaded into; :func:`sweep` removes those of ended
    processes and keeps a live one's and anything else."""
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    gone, live = int(ended.stdout), os.getpid()
    names = [f"faketime_shm_{gone}", f"sem.faketime_sem_{gone}", f"faketime_shm_{live}",
             f"sem.faketime_sem_{live}", "faketime_shm_x", "mmfleet-0"]  # fmt: skip
    for name in names:
        (tmp_path / name).write_bytes(b"")
    assert sweep(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])

"""producer.tools.bench.cpuhog: busy for its duty share of the time, then gone."""

from __future__ import annotations

import resource
import time

import pytest

from producer.tools.bench.cpuhog import main


def _children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def test_one_process_at_half_duty_burns_about_half_its_time() -> None:
    before, t0 = _children_cpu_s(), time.monotonic()
    assert main(["--procs", "1", "--duty", "0.5", "--seconds", "0.6"]) == 0
    wall = time.monotonic() - t0
    burnt = _children_cpu_s() - before
    assert 0.6 <= wall < 5.0
    assert 0.15 < burnt < 0.55, burnt  # about 0.3 s busy of 0.6 s


@pytest.mark.parametrize("args", [["--duty", "0"], ["--duty", "1.5"], ["--procs", "0"]])
def test_nonsense_is_refused(args: list[str]) -> None:
    with pytest.raises(SystemExit) as err:
        main(args)
    assert err.value.code == 2

"""The transport bench's pure parts: labels, tensors, the per-size summary, the tables."""

from __future__ import annotations

import io

import numpy as np
import pytest
from rich.console import Console

from producer.tools.bench import transport as tb
from producer.tools.bench import transport_env as tenv
from producer.tools.bench import transport_report as tr
from producer.tools.bench.workload import load_workload


class _Pool:
    def pool_bytes(self) -> int:
        return 0


def test_labels_and_tensors() -> None:
    assert [tr.size_label(n) for n in (1 << 20, 16 << 20, 128 << 20, 1000)] == [
        "1MB", "16MB", "128MB", "1000B",
    ]  # fmt: skip
    t = tb.tensor_of(1 << 20)
    assert t.dtype == np.float32 and t.nbytes == 1 << 20
    assert tb.tensor_of(1001).dtype == np.uint8 and tb.tensor_of(1001).nbytes == 1001
    assert tb.is_transport(load_workload("transport"))
    assert not tb.is_transport(load_workload("smoke"))


def test_memcpy_best_is_at_most_the_median() -> None:
    m = tenv.memcpy_ms(np.ones(1 << 16, np.float32), 5)
    assert 0 < m["best"] <= m["median"]


def summary(**errors: str) -> dict:
    runs = {
        "shm": tr.PathRun([10.0, 12.0, 11.0], [4.0, 5.0, 4.5], [0.1], message_bytes=900),
        "shm_fresh": tr.PathRun([16.0, 17.0, 18.0], [8.0, 8.0, 8.0], message_bytes=901),
        "inline": tr.PathRun([550.0, 600.0, 500.0], [100.0], message_bytes=200_000_000),
    }
    for path, msg in errors.items():
        runs[path] = tr.PathRun(error=msg)
    mem = {"shm": {"less_clients_delta": 48}}
    return tr.size_summary(
        128 << 20, np.ones(4, np.float32), {"best": 5.0, "median": 6.0}, 3.0, runs, mem, _Pool()
    )


def test_size_summary_ratios() -> None:
    s = summary()
    assert s["shm_ms"] == 11.0 and s["shm_fresh_ms"] == 17.0 and s["inline_ms"] == 550.0
    assert s["memcpy_ms"] == 5.0
    assert s["shm_over_memcpy"] == pytest.approx(11.0 / 5.0)
    assert s["shm_min_over_memcpy"] == pytest.approx(10.0 / 5.0)
    assert s["shm_fresh_over_memcpy"] == pytest.approx(17.0 / 5.0)
    assert s["put_fresh_ms"] == 8.0
    assert s["inline_over_shm"] == pytest.approx(50.0)
    assert s["put_ms"] == 4.5 and s["shm_rest_ms"] == pytest.approx(11.0 - 4.5 - 3.0)
    assert s["message_bytes_shm"] == 900 and s["message_bytes_inline"] == 200_000_000
    assert s["redis_memory_delta_shm"] == 48
    assert s["spread_ms"]["inline"] == {"min": 500.0, "median": 550.0, "max": 600.0}
    assert s["errors"] == {}


def test_a_refused_path_is_an_outcome_not_a_number() -> None:
    s = summary(inline="ResponseError: Protocol error: invalid bulk length")
    assert s["inline_ms"] is None and s["inline_over_shm"] is None
    assert "bulk length" in s["errors"]["inline"]
    report = {
        "workload": "transport",
        "repetitions": 3,
        "duration_s": 1.0,
        "machine": {"cores": 2},
        "transport": {"128MB": s, "1MB": summary()},
        "done_when": {
            "size": "128MB",
            "inline_over_shm": None,
            "shm_50x_faster_than_inline": None,
            "shm_over_memcpy": 2.2,
            "shm_within_2x_memcpy": False,
            "shm_fresh_over_memcpy": 3.4,
            "messages_under_64KB": True,
        },
        "warnings": ["128MB inline: refused"],
    }
    buf = io.StringIO()
    tr.print_transport_report(report, Console(file=buf, width=200))
    text = buf.getvalue()
    assert "refused" in text and "128MB" in text and "1MB" in text and "inline/shm" in text

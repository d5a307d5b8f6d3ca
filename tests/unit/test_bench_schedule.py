"""Send schedules and workload files: pure, deterministic, validated."""

from __future__ import annotations

import itertools
import random
import statistics
from collections import Counter

import pytest

from producer.tools.bench.limit import arrival_batches, default_batch_sizes, sorted_batches
from producer.tools.bench.schedule import (
    ClosedPicker,
    assign_mix,
    exact_shares,
    open_schedule,
    poisson_offsets,
)
from producer.tools.bench.transport import is_transport
from producer.tools.bench.workload import (
    WorkloadError,
    list_workloads,
    load_workload,
    parse_workload,
)

SOURCES = {
    "text": {"kind": "lines", "modality": "text", "path": "data/text/botchan_sentences.txt"},
    "image": {"kind": "images", "modality": "image", "path": "data/images"},
}
MODALITY_OF = {"text": "text", "image": "image"}


def workload(**kw: object) -> dict[str, object]:
    base: dict[str, object] = {
        "name": "t",
        "seed": 1,
        "warmup_s": 1.0,
        "sources": SOURCES,
        "phases": [
            {
                "name": "steady",
                "arrival": "poisson",
                "rate_rps": 50.0,
                "duration_s": 10.0,
                "mix": [
                    {"source": "text", "priority": "realtime", "weight": 3},
                    {"source": "image", "priority": "bulk", "weight": 1},
                ],
            }
        ],
    }
    base.update(kw)
    return base


def test_poisson_offsets_rate_and_bounds() -> None:
    offs = poisson_offsets(100.0, random.Random(0), duration_s=100.0)
    assert all(0 < a < b for a, b in itertools.pairwise(offs))
    assert offs[-1] < 100.0
    assert len(offs) == pytest.approx(10_000, rel=0.05)
    gaps = [b - a for a, b in itertools.pairwise(offs)]
    # exponential gaps: mean = stdev = 1 / rate
    assert statistics.mean(gaps) == pytest.approx(0.01, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(0.01, rel=0.08)
    assert len(poisson_offsets(5.0, random.Random(0), count=7)) == 7
    with pytest.raises(ValueError):
        poisson_offsets(5.0, random.Random(0))


@pytest.mark.parametrize(
    ("n", "weights", "want"),
    [(10, [1, 1], [5, 5]), (10, [3, 1], [8, 2]), (7, [1, 1, 1], [3, 2, 2]), (0, [1, 2], [0, 0])],
)
def test_exact_shares_sum_and_proportion(n: int, weights: list[float], want: list[int]) -> None:
    assert exact_shares(n, weights) == want
    assert sum(exact_shares(n, weights)) == n


def test_assign_mix_covers_every_entry_in_proportion() -> None:
    picks = assign_mix(9, [1, 1, 1], random.Random(4))
    assert Counter(picks) == {0: 3, 1: 3, 2: 3}
    assert picks != sorted(picks)  # shuffled


def test_open_schedule_is_deterministic_sorted_and_marks_warmup() -> None:
    w = parse_workload(workload())
    a = open_schedule(w, MODALITY_OF)
    b = open_schedule(w, MODALITY_OF)
    assert a == b
    assert [p.offset_s for p in a] == sorted(p.offset_s for p in a)
    assert all(p.measured == (p.offset_s >= 1.0) for p in a)
    by_source = Counter(p.source for p in a)
    assert by_source["text"] == pytest.approx(3 * by_source["image"], abs=3)
    # each source walks its inputs in order, from 0
    assert [p.input_index for p in a if p.source == "image"] == list(range(by_source["image"]))
    assert {p.priority for p in a if p.source == "text"} == {"realtime"}


def test_burst_plus_stream_schedule() -> None:
    w = parse_workload(
        workload(
            warmup_s=0.0,
            phases=[
                {"name": "backlog", "arrival": "burst", "count": 50,
                 "mix": [{"source": "text", "priority": "bulk"}]},
                {"name": "stream", "arrival": "poisson", "rate_rps": 10.0, "count": 5,
                 "start_s": 0.5, "mix": [{"source": "text", "priority": "realtime"}]},
            ],
        )
    )  # fmt: skip
    plan = open_schedule(w, MODALITY_OF)
    backlog = [p for p in plan if p.phase == "backlog"]
    assert len(backlog) == 50 and {p.offset_s for p in backlog} == {0.0}
    assert plan[:50] == backlog  # the burst comes first, in order
    stream = [p for p in plan if p.phase == "stream"]
    assert len(stream) == 5 and all(p.offset_s > 0.5 for p in stream)
    # both phases draw from one text cursor: no input is sent twice
    assert len({p.input_index for p in plan}) == 55


def test_closed_picker_is_deterministic() -> None:
    w = parse_workload(
        workload(phases=[{"name": "sat", "arrival": "closed", "concurrency": 4, "duration_s": 1,
                          "mix": [{"source": "text", "priority": "normal", "weight": 1},
                                  {"source": "image", "priority": "bulk", "weight": 1}]}])
    )  # fmt: skip
    assert open_schedule(w, MODALITY_OF) == []
    a = ClosedPicker(w, w.phases[0], MODALITY_OF)
    b = ClosedPicker(w, w.phases[0], MODALITY_OF)
    seq_a = [a.next(float(i)) for i in range(20)]
    assert seq_a == [b.next(float(i)) for i in range(20)]
    assert not seq_a[0].measured and seq_a[5].measured  # warmup_s = 1.0
    assert {p.source for p in seq_a} == {"text", "image"}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"phases": [{"name": "x", "arrival": "poisson", "count": 3,
                      "mix": [{"source": "text", "priority": "bulk"}]}]}, "rate_rps"),
        ({"phases": [{"name": "x", "arrival": "closed", "concurrency": 2,
                      "mix": [{"source": "text", "priority": "bulk"}]}]}, "count or duration_s"),
        ({"phases": [{"name": "x", "arrival": "burst",
                      "mix": [{"source": "text", "priority": "bulk"}]}]}, "count"),
        ({"phases": [{"name": "x", "arrival": "burst", "count": 2,
                      "mix": [{"source": "nope", "priority": "bulk"}]}]}, "unknown source"),
        ({"phases": [{"name": "x", "arrival": "burst", "count": 2,
                      "mix": [{"source": "text", "priority": "urgent"}]}]}, "priority"),
        ({"overrides": {"redis.port": 1}}, "bench owns"),
        ({"surprise": 1}, "surprise"),
        ({"phases": []}, "at least one phase"),
    ],
)  # fmt: skip
def test_invalid_workloads_are_refused_with_the_field(change: dict, message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        parse_workload(workload(**change))


def test_overrides_become_fleet_env_variables() -> None:
    w = parse_workload(workload(overrides={"modalities.text.batching.max_batch_size": 16}))
    assert w.env_overrides() == {"FLEET_MODALITIES__TEXT__BATCHING__MAX_BATCH_SIZE": "16"}


def test_shipped_workloads_parse_and_cover_the_issue() -> None:
    names = set(list_workloads())
    assert {"smoke", "mixed", "text-saturate", "image-saturate", "priority-burst",
            "transport"} <= names  # fmt: skip
    for name in names:
        w = load_workload(name)
        assert w.name == name
        if w.runnable:
            assert w.repetitions >= 3
    smoke = load_workload("smoke")
    cells = {(smoke.sources[m.source].modality, m.priority) for p in smoke.phases for m in p.mix}
    assert cells >= {(m, p) for m in ("text", "image")
                     for p in ("realtime", "high", "normal", "bulk")}  # fmt: skip
    burst = load_workload("priority-burst")
    backlog = next(p for p in burst.phases if p.arrival == "burst")
    assert backlog.count == 2000 and {m.priority for m in backlog.mix} == {"bulk"}
    transport = load_workload("transport")
    assert transport.runnable and is_transport(transport) and not is_transport(smoke)
    assert transport.sources["tensors"].sizes_bytes == [1 << 20, 16 << 20, 128 << 20]


def test_unknown_workload_lists_the_known_ones() -> None:
    with pytest.raises(WorkloadError, match="smoke"):
        load_workload("no-such-workload")


def test_limit_batches_sorted_by_length_within_buckets() -> None:
    keys = [("len32", 20), ("len16", 5), ("len32", 18), ("len16", 9), ("len16", 3)]
    assert sorted_batches(keys, 2) == [[4, 1], [3], [2, 0]]
    assert arrival_batches(5, 2) == [[0, 1], [2, 3], [4]]
    assert default_batch_sizes(32, [8, 16, 32, 64]) == [1, 8, 16, 32]
    with pytest.raises(ValueError):
        sorted_batches(keys, 0)

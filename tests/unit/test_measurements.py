"""The measurement pages rendered from small report files (no stack, no timing)."""

from __future__ import annotations

import json
import os
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

from producer.tools.measurements import MARKER, kind_of, main, read_reports, write_pages

# The days of the fixtures, built (no date literals in the repository outside the pages).
DAY = date(2031, 5, 6).isoformat()
NEXT = date(2031, 5, 7).isoformat()
COMPACT = DAY.replace("-", "")

BENCH: dict[str, Any] = {
    "schema": 1,
    "workload": "text-saturate",
    "started_utc": f"{DAY}T16:42:10.5+00:00",
    "finished_utc": f"{DAY}T16:50:02+00:00",
    "duration_s": 472.0,
    "repetitions": 3,
    "method": {"order": "interleaved"},
    "machine": {"cores": 2, "cpu": "Xeon", "load_avg_start": [0.31, 0, 0], "load_avg_end": [1.6]},
    "modes": {
        "fleet": {
            "text": {
                "throughput_rps": 233.9,
                "throughput_spread": {"min": 227.7, "median": 233.9, "max": 238.2},
                "throughput_reps": [238.2, 233.9, 227.7],
                "drain_rps": {"bulk": 231.0},
                "offered_rps": None,
                "requests": 3504,
                "ok": 3504,
                "errors": 0,
            }
        },
        "limit": {
            "text": {
                "throughput_rps": 245.2,
                "throughput_spread": {"min": 240.6, "median": 245.2, "max": 247.0},
                "throughput_reps": [240.6, 245.2, 247.0],
                "best_batch_size": 32,
                "unsorted_rps": 160.4,
            }
        },
        "celery-batches": {"text": {"throughput_rps": 114.6, "ok": 1700, "requests": 1700}},
    },
    "ratios": {
        "text": {
            "fleet_over_baseline": None,
            "fleet_over_limit": 0.954,
            "fleet_over_celery-batches": 2.041,
            "by_repetition": {"fleet_over_limit": [0.99, 0.94, 0.93]},
        }
    },
    "latency_ms": {
        "fleet": {
            "text": {
                "bulk": {
                    "n": 3504,
                    "p50": 1207.0,
                    "p95": 1650.5,
                    "p99": 1777.0,
                    "max": 1900.0,
                    "spread": {"p99": {"min": 1700.0, "median": 1777.0, "max": 1801.0}},
                },
                "realtime": {"n": 0, "p50": None},
            }
        }
    },
    "deadline_misses": {"fleet": {"text": {"bulk": 0.0125}}},
    "cold_start": {"fleet": {"text": {"ready_s": 3.8, "first_ms": 41.0, "warm_idle_ms": 12.5}}},
    "warnings": ["the machine was busy before the run"],
}
CHAOS = {
    "scenarios": [
        {
            "name": "worker_sigkill",
            "sent": 596,
            "completed": 595,
            "lost": 1,
            "duplicated_results": 2,
            "duplicated_executions": 0,
            "recover_s": 0.1,
            "worker_restart_s": [16.5, 16.4],
            "worker_exited": False,
        }
    ],
    "recover_limit_s": 30.0,
    "finished_at": f"{NEXT}T00:10:00Z",
}
COLDSTART = {
    "modalities": {
        "text": {
            "ready_s": 3.29,
            "first_result_s": 3.31,
            "burst": 64,
            "rate_per_s": 240.0,
            "errors": 0,
        }
    }
}
SUBMIT = {
    "workload": "submit-rate",
    "started_utc": f"{DAY}T19:54:00+00:00",
    "repetitions": 3,
    "submit_rate": {
        "requests": 5000,
        "chunk": 100,
        "paths": {
            "raw": {"rps": 146160.0, "cpu_us_per_request": 2.0},
            "submit_many": {"rps": 85357.0, "cpu_us_per_request": 10.0},
        },
        "ratios": {"submit_many_over_raw": 0.584},
        "verdict": {"target_submit_many_over_raw": 0.5, "met": True},
    },
}
TRANSPORT = {
    "workload": "transport",
    "started_utc": f"{DAY}T08:19:00+00:00",
    "transport": {
        "128MB": {
            "shm_ms": 20.4,
            "memcpy_ms": 11.9,
            "shm_over_memcpy": 1.71,
            "inline_ms": 8800.0,
            "inline_over_shm": 431.4,
            "message_bytes_shm": 1400,
        }
    },
    "done_when": {"size": "128MB", "shm_within_2x_memcpy": True},
}


def write(root: Path, name: str, data: Any) -> Path:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def generate(reports: Path, out: Path) -> list[Path]:
    return write_pages(read_reports(reports), out, "reports/")


def test_a_day_page_holds_each_report_with_its_figures(tmp_path: Path) -> None:
    reports, out = tmp_path / "reports", tmp_path / "pages"
    write(reports, f"bench/text-saturate-{COMPACT}T164210Z.json", BENCH)
    write(reports, "bench/latest.json", BENCH)  # the copy: not a second report
    write(reports, f"bench/submit-rate-{COMPACT}T195400Z.json", SUBMIT)
    write(reports, f"bench/transport-{COMPACT}T081900Z.json", TRANSPORT)
    write(reports, "chaos.json", CHAOS)

    generate(reports, out)
    page = (out / f"{DAY}.md").read_text()
    assert page.startswith(MARKER + f"\n# Measurements of {DAY} (UTC)")
    # the files it came from, in the order the runs started
    files = [line for line in page.splitlines() if line.startswith("- `")]
    assert files == [
        f"- `bench/transport-{COMPACT}T081900Z.json`",
        f"- `bench/text-saturate-{COMPACT}T164210Z.json`",
        f"- `bench/submit-rate-{COMPACT}T195400Z.json`",
    ]
    assert (
        f"## 16:42:10 UTC: bench `text-saturate` (`bench/text-saturate-{COMPACT}T164210Z.json`)"
        in page
    )
    assert "2 cores; Xeon; load average 0.31 -> 1.60" in page
    assert "| fleet | text | 233.9 | 227.7-238.2 | 238.2, 233.9, 227.7 | 3,504 | 3,504 |" in page
    assert (
        "| limit | text | 245.2 | 240.6-247.0 | 240.6, 245.2, 247.0 | - | - | - | 32 | 160.4 |"
        in page
    )
    # ratios to the limit and the peers, with each repetition's; a missing mode is no row
    assert "| text | fleet / limit | 0.954 | 0.990, 0.940, 0.930 |" in page
    assert "| text | fleet / celery-batches | 2.041 | - |" in page
    assert "fleet / baseline" not in page
    # latency with the deadline misses and the drain rate; a priority without requests is no row
    assert (
        "| fleet | text | bulk | 1,207.0 | 1,650.5 | 1,777.0 | 1,900.0 | 3,504 | 1.2 % | 231.0 |"
        in page
    )
    assert "| fleet | text | realtime |" not in page
    assert "| fleet | text | 3.80 | 41.0 | 12.5 | - | - |" in page
    assert "- the machine was busy before the run" in page
    assert "| `submit_many` | 85,357 | - | 10.0 | 0.584 |" in page
    assert "`submit_many` / raw 0.584 against 0.50: met yes." in page
    assert "| 128MB | 20.4 | - | 8,800.0 | 11.90 | 1.71 | 431 |" in page
    assert "shm within 2x memcpy yes" in page

    # chaos holds only when it finished: that day, said so, with its lost and duplicated
    chaos = (out / f"{NEXT}.md").read_text()
    assert "## finished 00:10:00 UTC: chaos (`chaos.json`)" in chaos
    assert "| worker_sigkill | 596 | 595 | 1 | 2 | 0 | 0.10 | 16.5, 16.4 | no |" in chaos

    index = (out / "index.md").read_text()
    assert index.index(f"[{NEXT}]({NEXT}.md) (generated)") < index.index(
        f"[{DAY}]({DAY}.md) (generated)"
    )
    assert "  - finished 00:10:00 UTC: chaos (`chaos.json`)" in index


def test_a_report_without_a_time_goes_by_its_file(tmp_path: Path) -> None:
    reports, out = tmp_path / "reports", tmp_path / "pages"
    path = write(reports, "coldstart.json", COLDSTART)
    when = datetime(2031, 1, 2, 3, 4, 5, tzinfo=UTC)
    os.utime(path, (when.timestamp(), when.timestamp()))
    [rep] = read_reports(reports)
    assert kind_of(rep.data) == "coldstart"
    assert rep.time_from == "file modification time"
    generate(reports, out)
    page = (out / f"{when.date().isoformat()}.md").read_text()
    assert "## 03:04:05 UTC (the file's time: the report holds none): cold start" in page
    assert "| text | 3.29 | 3.31 | 64 | 240.0 | 0 |" in page


def test_transcribed_pages_are_never_written(tmp_path: Path) -> None:
    reports, out = tmp_path / "reports", tmp_path / "pages"
    out.mkdir()
    transcribed = f"# Measurements of {NEXT} (UTC)\n\nTranscribed.\n\n## Chaos, by hand\n"
    (out / f"{NEXT}.md").write_text(transcribed)
    write(reports, "chaos.json", CHAOS)
    written = generate(reports, out)
    assert (out / f"{NEXT}.md").read_text() == transcribed
    assert written == [out / f"{NEXT}-reports.md", out / "index.md"]
    assert "| worker_sigkill | 596 |" in (out / f"{NEXT}-reports.md").read_text()
    index = (out / "index.md").read_text()
    assert f"- [{NEXT}]({NEXT}.md) (transcribed)\n  - Chaos, by hand\n" in index
    assert f"- [{NEXT}-reports]({NEXT}-reports.md) (generated)" in index


def test_a_rewrite_keeps_sections_of_reports_gone_from_the_folder(tmp_path: Path) -> None:
    reports, out = tmp_path / "reports", tmp_path / "pages"
    bench = write(reports, f"bench/text-saturate-{COMPACT}T164210Z.json", BENCH)
    write(reports, f"bench/submit-rate-{COMPACT}T195400Z.json", SUBMIT)
    generate(reports, out)
    first = (out / f"{DAY}.md").read_text()
    bench.unlink()  # reports/ is gitignored: emptied, the page stays the record
    write(reports, f"bench/transport-{COMPACT}T081900Z.json", TRANSPORT)
    assert main(["--reports", str(reports), "--out", str(out)]) == 0
    page = (out / f"{DAY}.md").read_text()
    kept = first[first.index("<!-- report: bench/text-saturate") :].split("<!-- report:")[1]
    assert "<!-- report:" + kept in page
    assert "| fleet | text | 233.9 |" in page
    assert page.count("<!-- report: ") == 3
    assert (
        f"- `bench/text-saturate-{COMPACT}T164210Z.json` ({DAY}T16:42:10Z; no longer in "
        f"`{reports.as_posix()}/`)" in page
    )
    # rendered again from the same files: the same page
    main(["--reports", str(reports), "--out", str(out)])
    assert (out / f"{DAY}.md").read_text() == page


def test_a_bench_with_cpu_accounting_gets_its_cost_tables() -> None:
    from producer.tools.measurements import render_bench

    r = {
        "workload": "overhead-saturate",
        "modes": {},
        "cpu_us_per_request": {
            "fleet": {"producer": 196.4, "redis": 101.8, "worker": 475.9, "total": 774.1},
            "ray-serve": {"producer": 475.2, "ray:raylet": 21.6, "worker": 21.6, "total": 497.0},
        },
        "redis_cpu_us_per_request": {"fleet": 100.0, "ray-serve": 0.0},
        "accounting": {
            "fleet": {"rps": 1746.3, "redis_cpu_us_per_request": 100.0,
                      "redis_commands_per_request": 14.49, "redis_bound_rps": 10000,
                      "redis_usec_by_command": {"evalsha": 62.08, "rpop": 2.21}},
            "ray-serve": {"rps": 240.3, "redis_usec_by_command": {}},
        },
    }  # fmt: skip
    page = "\n".join(render_bench(r))
    assert (
        "| mode | req/s (window) | producer us | redis us | worker us | ray:raylet us | total us |"
        in page
    )
    assert (
        "| fleet | 1,746.3 | 196.4 | 101.8 | 475.9 | - | 774.1 | 100.00 | 14.49 | 10,000 |" in page
    )
    assert "| fleet | evalsha 62.08, rpop 2.21 |" in page
    assert "| ray-serve | - |" in page


def test_redis_load_and_scaleout_reports_name_their_model(tmp_path: Path) -> None:
    reports, out = tmp_path / "reports", tmp_path / "pages"
    redisload = {
        "started_utc": f"{DAY}T10:00:00Z",
        "model": "identity",
        "workers": 2,
        "redis_version": "6.2.14",
        "idle": {"s": 10.0, "commands_per_s": 14.0, "cpu_us_per_s": 1935,
                 "per_worker": {"commands_per_s": 7.0, "cpu_us_per_s": 967}},
        "load": {"requests": 3000, "rps": 963.5, "commands_per_request": 11.45,
                 "cpu_us_per_request": 57.8},
        "redis_max_rps": 17301,
    }  # fmt: skip
    row = {"hosts": 10, "offered_rps": 3854.0, "achieved_rps": 3854.0, "utilisation": 0.23}
    sim = {
        "model": "identity",
        "host_rps": 481.8,
        "host_rps_source": "the redisload run's drain rate per worker (identity model)",
        "load": 0.8,
        "costs": {"commands_per_request": 11.45, "cpu_us_per_request": 57.8,
                  "idle_cpu_us_per_s": 967.0},
        "saturation": {"hosts_at_100pct": 43.0, "rps_at_100pct": 16581, "ceiling_rps": 17301},
        "rows": [row],
    }  # fmt: skip
    assert kind_of(redisload) == "redisload" and kind_of({"scaleout": [sim]}) == "scaleout"
    assert kind_of([row]) == "scaleout"  # the older bare list of rows
    write(reports, "redisload-identity.json", redisload)
    os.utime(write(reports, "scaleout.json", {"scaleout": [sim]}), (1.8e9, 1.8e9))
    generate(reports, out)
    page = "".join(p.read_text() for p in sorted(out.glob("*.md")) if p.name != "index.md")
    assert "| model | identity |" in page and "| idle CPU µs/s per worker | 967 |" in page
    assert "**identity model** (offered 80%)." in page
    assert "| requests/s at 100 % Redis | 16,581 |" in page
    assert "| 10 | 3,854.00 | 3,854.00 | 0.23 |" in page

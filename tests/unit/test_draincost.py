"""draincost's pure parts: commands per request from two INFO snapshots, py-spy summaries."""

from __future__ import annotations

from pathlib import Path

from producer.tools.bench.draincost import command_delta, summarize


def test_command_delta_is_per_request_and_ordered_by_time() -> None:
    before = {"evalsha": (10, 1000), "get": (5, 50), "ping": (3, 3)}
    after = {"evalsha": (12, 5000), "get": (105, 250), "ping": (3, 3), "set": (100, 100)}
    out = command_delta(before, after, 100)
    assert list(out) == ["evalsha", "get", "set"]  # ping did not run in the window
    assert out["evalsha"] == {"calls": 0.02, "us": 40.0}
    assert out["get"] == {"calls": 1.0, "us": 2.0}
    assert out["set"] == {"calls": 1.0, "us": 1.0}


def test_summarize_counts_each_function_once_per_stack(tmp_path: Path) -> None:
    raw = tmp_path / "round-0.txt"
    raw.write_text(
        "main (a.py:1);f (b.py:2);f (b.py:3) 3\n"  # f twice in one stack: counted once
        "main (a.py:1);g (c.py:9) 1\n"
    )
    assert dict(summarize(raw)) == {"main a.py": 100.0, "f b.py": 75.0, "g c.py": 25.0}

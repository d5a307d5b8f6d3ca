"""The bench's CPU and Redis accounting (producer/tools/bench/accounting.py), without servers."""

from __future__ import annotations

from pathlib import Path

import pytest

from producer.tools.bench.accounting import (
    CLK_TCK,
    Accountant,
    ProcStat,
    Snapshot,
    combine_windows,
    completed_between,
    descendants,
    idle_rates,
    load_window,
    parse_stat,
    per_request_us,
    process_role,
    redis_io_figures,
    tick_delta,
    tree_ticks,
    window_figures,
)
from producer.tools.bench.records import Record
from producer.tools.bench.runner import worker_counts
from producer.tools.bench.workload import parse_workload

# A real line's shape: comm in parentheses (here with a space and a parenthesis in it).
STAT = (
    "4242 (celery (x) w) S 4000 4242 4242 0 -1 4194560 3000 0 0 0 "
    "150 25 7 3 20 0 3 0 123456 1000000 2000 18446744073709551615"
)


def _stat(pid: int, ppid: int, u: int, s: int = 0, cu: int = 0, cs: int = 0) -> ProcStat:
    return ProcStat(pid, f"p{pid}", ppid, u, s, cu, cs)


def test_parse_stat_reads_ids_and_cpu_ticks_past_an_odd_comm() -> None:
    st = parse_stat(STAT)
    assert (st.pid, st.comm, st.ppid) == (4242, "celery (x) w", 4000)
    assert (st.utime, st.stime, st.cutime, st.cstime) == (150, 25, 7, 3)
    assert st.ticks == 185
    with pytest.raises(ValueError):
        parse_stat("garbage")


def test_a_tree_is_the_root_and_its_living_descendants() -> None:
    procs = {p.pid: p for p in (_stat(1, 0, 9), _stat(10, 1, 5), _stat(11, 10, 2, 1),
                                _stat(12, 10, 4), _stat(20, 1, 100))}  # fmt: skip
    assert sorted(descendants(procs, 10)) == [10, 11, 12]
    assert descendants(procs, 99) == []
    assert tree_ticks(procs, 10) == {10: 5, 11: 3, 12: 4}


def test_tick_delta_counts_new_processes_from_zero_and_never_goes_negative() -> None:
    before = {10: 100, 11: 50}
    after = {10: 130, 12: 7}  # 11 exited (reaped: its CPU is in 10's cutime), 12 was born
    assert tick_delta(before, after) == 30 + 7


def test_process_roles_group_workers_and_split_ray() -> None:
    assert process_role("worker-text") == process_role("worker-text-3") == "worker"
    assert process_role("peer-celery-batches-text") == "worker"
    assert process_role("redis") == "redis"
    assert process_role("flower") == "flower"
    ray = "peer-ray-serve-text"
    assert process_role(ray, "/x/ray/core/src/ray/raylet/raylet --node_ip=1") == "ray:raylet"
    assert process_role(ray, "/x/gcs_server --port 1") == "ray:gcs_server"
    assert process_role(ray, "ray::ServeReplica:app:Model") == "ray:ServeReplica"
    assert process_role(ray, "ray::ProxyActor") == "ray:ProxyActor"
    assert process_role(ray, "python -m producer.tools.bench.peers.ray_app --port 1") == (
        "ray:driver"
    )


def _snap(t: float, ticks: dict[str, dict[int, int]], calls: dict[str, int],
          usec: dict[str, int], cpu: float) -> Snapshot:  # fmt: skip
    return Snapshot(t, ticks, calls, usec, cpu)


def test_window_divides_by_completions_and_subtracts_the_idle_background() -> None:
    tick_us = 1e6 / CLK_TCK
    idle = idle_rates(
        _snap(0.0, {"worker": {5: 0}}, {"rpop": 0, "info": 0}, {"rpop": 0}, 1.0),
        _snap(2.0, {"worker": {5: 2}}, {"rpop": 20, "info": 4}, {"rpop": 40}, 1.002),
    )
    assert idle["calls_per_s"] == {"rpop": 10.0}  # the harness's INFO left out
    assert idle["redis_cpu_s_per_s"] == pytest.approx(0.001)
    assert idle["cpu_us_per_s"]["worker"] == pytest.approx(tick_us)

    a = _snap(10.0, {"producer": {1: 100}, "redis": {2: 50}, "worker": {5: 10}},
              {"rpop": 100, "lpush": 0, "info": 10}, {"rpop": 500, "lpush": 0}, 5.0)  # fmt: skip
    b = _snap(20.0, {"producer": {1: 300}, "redis": {2: 150}, "worker": {5: 410, 6: 0}},
              {"rpop": 1100, "lpush": 1000, "info": 12}, {"rpop": 2900, "lpush": 3000},
              5.51)  # fmt: skip
    f = window_figures(a, b, 1000, idle)
    assert f["window_s"] == 10.0 and f["rps"] == 100.0
    assert f["cpu_us_per_request"]["producer"] == pytest.approx(200 * tick_us / 1000, abs=0.1)
    assert f["cpu_us_per_request"]["worker"] == pytest.approx(400 * tick_us / 1000, abs=0.1)
    assert f["cpu_us_per_request"]["total"] == pytest.approx(700 * tick_us / 1000, abs=0.1)
    # rpop: 1000 calls less 10/s x 10 s of background; usec 2400 less 20/s x 10 s
    assert f["redis_calls_by_command"] == {"lpush": 1.0, "rpop": 0.9}
    assert f["redis_usec_by_command"] == {"lpush": 3.0, "rpop": 2.2}
    assert f["redis_commands_per_request"] == 1.9
    # 0.51 s of Redis CPU less 0.001 s/s x 10 s, over 1000 requests
    assert f["redis_cpu_us_per_request"] == pytest.approx(500.0)
    assert f["cpu_cores"]["worker"] == pytest.approx(400 * tick_us / 10 / 1e6, abs=1e-3)


def test_no_completions_gives_no_per_request_figures() -> None:
    assert per_request_us({"worker": 5.0}, 0) == {"worker": None, "total": None}
    f = window_figures(_snap(0, {}, {}, {}, 0.0), _snap(1, {}, {}, {}, 0.1), 0)
    assert f["redis_cpu_us_per_request"] is None and f["redis_usec_by_command"] == {}


def test_combine_windows_takes_medians_per_key() -> None:
    def w(us: float, rps: float) -> dict:
        return {"window_s": 12.0, "completed": 10, "rps": rps, "cpu_cores": {"worker": 0.5},
                "cpu_us_per_request": {"worker": us, "total": us * 2},
                "redis_cpu_us_per_request": us / 10, "redis_commands_per_request": 3.0,
                "redis_calls_by_command": {"rpop": 1.0},
                "redis_usec_by_command": {"rpop": us / 100, "lpush": 9.0},
                "redis_io_per_request": {"net_in_bytes": us * 10, "forked_cpu_us": 0}}  # fmt: skip

    c = combine_windows([w(100, 50), w(300, 70), w(200, 60)])
    assert c["repetitions"] == 3 and c["completed"] == 30 and c["rps"] == 60
    assert c["cpu_us_per_request"] == {"worker": 200, "total": 400}
    assert c["redis_cpu_us_per_request"] == 20
    assert list(c["redis_usec_by_command"]) == ["lpush", "rpop"]
    assert c["redis_io_per_request"] == {"net_in_bytes": 2000, "forked_cpu_us": 0}
    assert combine_windows([]) == {}


def test_completed_between_counts_successes_done_inside_the_window() -> None:
    def rec(done: float | None, ok: bool) -> Record:
        return Record("i", 0, "p", "text", "bulk", "s", 0, True, None, 0.0, done_ms=done, ok=ok)

    recs = [rec(5.0, True), rec(10.0, True), rec(15.0, False), rec(19.9, True), rec(20.0, True),
            rec(None, True)]  # fmt: skip
    assert completed_between(recs, 10.0, 20.0) == 2


def _workload(**extra: object):
    data = {"name": "w", "warmup_s": 3.0,
            "sources": {"t": {"kind": "lines", "modality": "text", "path": "x.txt"}},
            "phases": [{"name": "s", "arrival": "closed", "concurrency": 8, "duration_s": 15.0,
                        "mix": [{"source": "t", "priority": "bulk"}]}], **extra}  # fmt: skip
    return parse_workload(data)


def test_the_window_runs_from_the_warmup_to_the_load_end() -> None:
    assert load_window(_workload()) == (3.0, 15.0)
    with pytest.raises(Exception, match="accounting_idle_s"):
        _workload(accounting_idle_s=2.0, warmup_s=20.0)


def test_worker_counts_from_the_workload_and_the_environment() -> None:
    w = _workload(workers={"text": 2})
    assert worker_counts(w) == {"text": 2}
    assert worker_counts(w, "text=4") == {"text": 4}
    with pytest.raises(Exception, match="FLEET_BENCH_WORKERS"):
        worker_counts(w, "nope=2")


def test_an_accountant_reads_a_fake_proc_tree(tmp_path: Path) -> None:
    proc, pids = tmp_path / "proc", tmp_path / "pids"
    pids.mkdir()
    (pids / "worker-text.pid").write_text("100")
    (pids / "redis.pid").write_text("200")
    for pid, ppid, u in ((100, 1, 10), (101, 100, 5), (200, 1, 40), (300, 1, 7)):
        d = proc / str(pid)
        d.mkdir(parents=True)
        (d / "stat").write_text(f"{pid} (x) S {ppid} 0 0 0 0 0 0 0 0 0 {u} 1 0 0 20 0 1 0")

    class CannedInfo:  # INFO's and CLIENT LIST's replies as redis-py parses them
        def info(self, section: str) -> dict:
            if section == "cpu":
                return {"used_cpu_sys": 1.0, "used_cpu_user": 2.0, "used_cpu_sys_children": 0.5}
            if section == "stats":
                return {"total_net_input_bytes": 4096, "total_reads_processed": 12}
            if section == "clients":
                return {"connected_clients": 3}
            return {"cmdstat_get": {"calls": 3, "usec": 9}}

        def client_list(self) -> list[dict]:
            return [{"sub": "0", "psub": "1"}, {"sub": "0", "psub": "0"}, {"sub": "2", "psub": "0"}]

    snap = Accountant(pids, CannedInfo(), proc_root=proc).snapshot()
    assert snap.ticks["worker"] == {100: 11, 101: 6}
    assert snap.ticks["redis"] == {200: 41}
    assert snap.calls == {"get": 3} and snap.redis_cpu_s == 3.0
    assert snap.redis_io["total_net_input_bytes"] == 4096.0
    assert snap.redis_io["used_cpu_sys_children"] == 0.5
    assert snap.redis_io["connected_clients"] == 3.0
    assert snap.redis_io["pubsub_clients"] == 2.0  # a pattern and a channel subscriber
    assert "total_forks" not in snap.redis_io  # a field this Redis did not report


def test_redis_io_per_request_is_the_servers_io_over_the_window() -> None:
    """4,000 requests over a window in which Redis read 8 MB and wrote 6 MB on sockets in 1,600
    reads and 2,000 writes, spent 0.2 s (0.05 s of it in the kernel), and a fork (an AOF
    rewrite) spent 0.04 s more."""
    a = {
        "total_net_input_bytes": 1e6, "total_net_output_bytes": 2e6,
        "total_reads_processed": 400.0, "total_writes_processed": 500.0,
        "used_cpu_sys": 1.0, "used_cpu_user": 3.0,
        "used_cpu_sys_children": 0.0, "used_cpu_user_children": 0.0, "total_forks": 2.0,
        "connected_clients": 9.0, "pubsub_clients": 2.0,
    }  # fmt: skip
    b = {
        **a,
        "total_net_input_bytes": 9e6, "total_net_output_bytes": 8e6,
        "total_reads_processed": 2000.0, "total_writes_processed": 2500.0,
        "used_cpu_sys": 1.05, "used_cpu_user": 3.15,
        "used_cpu_sys_children": 0.01, "used_cpu_user_children": 0.03, "total_forks": 3.0,
        "connected_clients": 12.0, "pubsub_clients": 3.0,
    }  # fmt: skip
    f = redis_io_figures(a, b, 4000)
    assert f["net_in_bytes"] == 2000.0 and f["net_out_bytes"] == 1500.0
    assert f["socket_reads"] == 0.4 and f["socket_writes"] == 0.5
    assert f["kernel_share"] == 0.25  # 0.05 of 0.2 s
    assert f["forked_cpu_us"] == 10.0  # 0.04 s over 4,000 requests
    assert f["forks"] == 1.0
    assert f["connected_clients"] == 12.0 and f["pubsub_clients"] == 3.0  # at the end
    assert redis_io_figures(a, b, 0) == {} and redis_io_figures({}, b, 10) == {}


def test_ray_roles_are_summed_as_the_worker_once() -> None:
    out = per_request_us({"producer": 100.0, "ray:raylet": 50.0, "ray:ServeReplica": 250.0}, 10)
    assert out["worker"] == 30.0 and out["ray:raylet"] == 5.0
    assert out["total"] == 40.0

"""The first hour's traps, each driven through the ``fleet`` CLI as a subprocess
on a real stack of this module's own (Redis + two text replicas + Flower, started by
``fleet up``), asserting the message and the exit code: 0 ok, 1 the request failed or timed
out, 2 refused input, 3 the stack or broker is not usable.

The stack is started with its ports in the environment of ``fleet up`` only: later commands
get just ``FLEET_STACK__RUN_DIR``, as a user's next shell would, and find the rest in the
run dir's ``stack.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.request import urlopen

import pytest

from producer.stack.local import free_port
from shared.procs import running
from tests.conftest import free_port_block

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "data"
VIDEO = DATA / "videos" / "torchcodec_nasa_13013.mp4"  # 657 KB: travels through /dev/shm
HOST = socket.gethostname()


def base_env(**extra: str) -> dict[str, str]:
    """The caller's environment without any FLEET_* variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("FLEET_")}
    # No queue exporter unless a test gives it a port (its default, 9100, is a user's).
    env.update({"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                "FLEET_METRICS__EXPORTER_PORT": "0", **extra})  # fmt: skip
    return env


def fleet(
    *args: str, env: dict[str, str], cwd: Path = REPO, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "producer.cli", *args],
        capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout,
    )  # fmt: skip


def assert_short(proc: subprocess.CompletedProcess[str], max_lines: int = 2) -> None:
    """An expected condition: at most ``max_lines`` on stderr and no traceback."""
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert 0 < len(proc.stderr.strip().splitlines()) <= max_lines, proc.stderr


class Traps:
    def __init__(self, run_dir: Path, shm_root: Path, up_env: dict[str, str]) -> None:
        self.run_dir = run_dir
        self.shm_root = shm_root
        self.up_env = up_env
        # What a later shell has: only the run dir and the shm root of this test's stack.
        self.env = base_env(
            FLEET_STACK__RUN_DIR=str(run_dir), FLEET_TRANSPORT__SHM_ROOT=str(shm_root)
        )

    def pid(self, name: str) -> int:
        return int((self.run_dir / "pids" / f"{name}.pid").read_text())


@pytest.fixture(scope="module")
def traps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traps]:
    run_dir = tmp_path_factory.mktemp("traps") / "run"
    shm_root = Path("/dev/shm") / f"mmfleet-test-traps-{uuid.uuid4().hex[:8]}"
    up_env = base_env(
        FLEET_STACK__RUN_DIR=str(run_dir),
        FLEET_TRANSPORT__SHM_ROOT=str(shm_root),
        FLEET_REDIS__PORT=str(free_port()),
        FLEET_FLOWER__PORT=str(free_port()),
        FLEET_METRICS__PORT_BASE=str(free_port_block(8)),
        FLEET_METRICS__EXPORTER_PORT=str(free_port()),
        FLEET_MODALITIES__TEXT__BATCHING__MAX_BATCH_SIZE="16",  # a shorter warmup
        FLEET_MODALITIES__IMAGE__BATCHING__MAX_BATCH_SIZE="4",
    )
    t = Traps(run_dir, shm_root, up_env)
    up = fleet(
        "up", "--modalities", "text,image", "--replicas", "text=2", "--no-gateway",
        env=up_env, timeout=400,
    )  # fmt: skip
    try:
        assert up.returncode == 0, up.stderr
        assert "started worker-text-1" in up.stdout
        yield t
    finally:
        pids = [int(p.read_text()) for p in (run_dir / "pids").glob("*.pid")]
        down = fleet("down", env=t.env)
        shutil.rmtree(shm_root, ignore_errors=True)
        assert down.returncode == 0, down.stderr
        assert not [p for p in pids if running(p)], "fleet down left processes running"


# -- 7: replicas ------------------------------------------------------------------------------
def test_replicas_have_their_own_node_names_logs_and_metrics_ports(traps: Traps) -> None:
    st = fleet("status", env=traps.env)
    assert st.returncode == 0, st.stderr
    status = json.loads(st.stdout)
    assert status["processes"] == {"exporter": True, "flower": True, "redis": True,
                                   "worker-image": True, "worker-text": True,
                                   "worker-text-1": True}  # fmt: skip
    texts = sorted([f"text@{HOST}", f"text-1@{HOST}"])
    assert status["live_workers"] == {"image": [f"image@{HOST}"], "text": texts}
    assert status["dead_workers"] == []
    logs = traps.run_dir / "logs"
    assert "ready" in (logs / "worker-text.log").read_text()
    assert "ready" in (logs / "worker-text-1.log").read_text()
    base = int(traps.up_env["FLEET_METRICS__PORT_BASE"])
    for port in (base, base + 4):  # replica 0: base + 0; replica 1: base + 4 * 1 + 0
        with urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            assert 'fleet_prefetch_held{modality="text"}' in r.read().decode()


# -- 3 and 4b: from any directory, without the stack's FLEET_* variables -----------------------
def test_commands_find_the_running_stack_from_another_directory(
    traps: Traps, tmp_path: Path
) -> None:
    flower = fleet("flower", env=traps.env, cwd=tmp_path)
    assert flower.returncode == 0, flower.stderr
    assert f"127.0.0.1:{traps.up_env['FLEET_FLOWER__PORT']}" in flower.stdout  # not 5555
    st = fleet("status", env=traps.env, cwd=tmp_path)
    assert st.returncode == 0, st.stderr
    assert json.loads(st.stdout)["run_dir_from"] == "set by FLEET_STACK__RUN_DIR"


def test_no_stack_in_the_run_dir_is_one_message_and_exit_3(tmp_path: Path) -> None:
    env = base_env(FLEET_STACK__RUN_DIR=str(tmp_path / "never-started"))
    for args in (["status"], ["submit", "text", "--text", "hello"], ["flower"]):
        proc = fleet(*args, env=env, cwd=tmp_path)
        assert proc.returncode == 3, (args, proc.stderr)
        assert_short(proc)
        assert "make up" in proc.stderr and str(tmp_path / "never-started") in proc.stderr


def test_run_dir_is_found_in_the_project_root_from_a_subdirectory(tmp_path: Path) -> None:
    project = tmp_path / "checkout"
    (project / "configs").mkdir(parents=True)
    shutil.copy(REPO / "configs" / "fleet.toml", project / "configs" / "fleet.toml")
    (project / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (project / "sub" / "dir").mkdir(parents=True)
    proc = fleet("status", env=base_env(), cwd=project / "sub" / "dir")
    assert proc.returncode == 3, proc.stderr  # nothing started there
    assert json.loads(proc.stdout)["run_dir"] == str(project / ".run")
    assert f"in the project root {project}" in proc.stderr
    assert_short(proc)


# -- 2: authentication vs unreachable; status exit codes ------------------------------------
def test_wrong_password_is_reported_as_authentication_at_once(traps: Traps) -> None:
    env = {**traps.env, "FLEET_REDIS__PASSWORD": "not-the-password"}
    t0 = time.monotonic()
    proc = fleet("submit", "text", "--text", "hello", env=env)
    assert proc.returncode == 3, proc.stderr
    assert time.monotonic() - t0 < 5.0  # not kombu's retries (6.6 s before)
    assert "authentication failed" in proc.stderr and "FLEET_REDIS__PASSWORD" in proc.stderr
    assert "is the stack up" not in proc.stderr
    assert_short(proc)
    st = fleet("status", env=env)
    assert st.returncode == 3 and "authentication failed" in st.stderr


def timed(*args: str, env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    proc = fleet(*args, env=env)
    return proc, time.monotonic() - t0


def test_unreachable_redis_says_connection_refused_at_once(traps: Traps) -> None:
    env = {**traps.env, "FLEET_REDIS__PORT": str(free_port())}
    # Against a refusal before any connection (a blank text), so the start-up cancels out.
    base = min(timed("submit", "text", "--text", " ", env=env)[1] for _ in range(2))
    for args in (["submit", "text", "--text", "hello"], ["status"], ["result", "some-id"]):
        proc, took = timed(*args, env=env)
        assert proc.returncode == 3, (args, proc.stderr)
        assert "connection refused" in proc.stderr and "FLEET_REDIS__PORT" in proc.stderr
        assert_short(proc)
        # The refused connection itself is immediate (no retries); what remains over the
        # blank-text refusal is importing redis, up to a second on a loaded 2-core machine.
        # redis-py's default retries took 3-5 s more.
        assert took - base < 2.0, (args, took, base)


# -- a negative --wait-s ------------------------------------------------------------------------
def test_negative_wait_is_refused_in_one_line(traps: Traps) -> None:
    for args in (["submit", "text", "--text", "hello", "--wait-s", "-1"],
                 ["result", "some-id", "--wait-s", "-0.5"],
                 ["watch", "some-id", "--timeout-s", "-3"]):  # fmt: skip
        proc = fleet(*args, env=traps.env)
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stderr.startswith(f"{args[-2]} must be 0 or more seconds, not "), proc.stderr
        assert_short(proc, 1)
        assert proc.stdout == ""  # nothing submitted, no result printed


# -- 1: a modality without a live worker ------------------------------------------------------
def segments(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_submit_to_a_modality_without_worker_fails_fast_and_sends_nothing(
    traps: Traps,
) -> None:
    before = segments(traps.shm_root)
    t0 = time.monotonic()
    proc = fleet("submit", "video", "--file", str(VIDEO), env=traps.env)
    assert time.monotonic() - t0 < 10.0  # not the 120 s wait
    assert proc.returncode == 3, proc.stderr
    err = json.loads(proc.stdout)["error"]
    assert err["code"] == "NO_READY_WORKER"
    assert "no live worker consumes the 'video' queue" in err["message"]
    assert "fleet up --modalities video" in proc.stderr
    assert segments(traps.shm_root) == before  # no 657 KB segment left behind
    assert "Traceback" not in proc.stderr


def test_queue_anyway_warns_and_result_and_shm_gc_explain_the_waiting_request(
    traps: Traps,
) -> None:
    proc = fleet("submit", "video", "--file", str(VIDEO), "--wait-s", "0", env=traps.env)
    assert proc.returncode == 0, proc.stderr
    assert "warning: no live worker consumes the 'video' queue" in proc.stderr
    assert "queued anyway" in proc.stderr
    task_id = json.loads(proc.stdout)["id"]
    res = fleet("result", task_id, env=traps.env)
    assert res.returncode == 1
    first = json.loads(res.stdout)
    assert first["id"] == task_id and first["state"] == "PENDING"
    assert first["where"] == "queued" and first["queue"] == "video"
    assert 1 <= first["position"] <= first["queued"]
    assert "no final result yet: PENDING (queued, position" in res.stderr
    assert (
        "no live worker consumes queue 'video': start one with `fleet up --modalities video`"
        in (res.stderr)
    )
    gc = fleet("shm", "gc", env=traps.env)
    assert gc.returncode == 0, gc.stderr
    assert gc.stdout.startswith("removed 0 segment(s)")
    kept = [line for line in gc.stdout.splitlines() if line.startswith("kept t")]
    # bound to its request: kept while that request may still run (shared.transport.lifetime)
    assert len(kept) == 1 and f"the input of request {task_id}: renewed" in kept[0], kept


def test_result_and_watch_tell_a_queued_request_from_an_unknown_id(traps: Traps) -> None:
    """A second request queued behind the first on the video queue (no video worker) has the
    position after it; ``fleet watch`` says where it is every --report-s; an id the fleet
    never saw (a fresh UUID, or a mistyped one) exits 4 at once."""
    first = fleet("submit", "raw", "video", "--inputs", '{"video_b64": "AAAA"}', "--wait-s",
                  "0", env=traps.env)  # fmt: skip
    second = fleet("submit", "raw", "video", "--inputs", '{"video_b64": "AAAA"}', "--wait-s",
                   "0", env=traps.env)  # fmt: skip
    assert first.returncode == 0 and second.returncode == 0, second.stderr
    ids = [json.loads(p.stdout)["id"] for p in (first, second)]
    where = [json.loads(fleet("result", i, env=traps.env).stdout) for i in ids]
    pasted = fleet("result", f" {ids[1]}\n", env=traps.env)  # copied with blanks around it
    assert pasted.returncode == 1 and json.loads(pasted.stdout)["id"] == ids[1], pasted.stderr
    assert where[1]["position"] == where[0]["position"] + 1
    assert where[1]["queued"] == where[0]["queued"] >= 2

    watch = fleet("watch", ids[1], "--timeout-s", "2.5", "--report-s", "1", env=traps.env)
    assert watch.returncode == 1, watch.stderr
    lines = [json.loads(ln) for ln in watch.stdout.splitlines()]
    assert lines[0]["where"] == "queued" and lines[0]["position"] == where[1]["position"]
    assert lines[-1]["error"]["code"] == "WAIT_TIMEOUT"
    still = [ln for ln in watch.stderr.splitlines() if ln.startswith("still queued, position")]
    assert still and f"of {where[1]['queued']} in queue 'video'" in still[0], watch.stderr
    assert "no live worker consumes queue 'video'" in still[0]

    for unknown in (str(uuid.uuid4()), ids[1][:-1] + ("0" if ids[1][-1] != "0" else "1")):
        res = fleet("result", unknown, "--wait-s", "30", env=traps.env)
        assert res.returncode == 4, res.stderr
        assert json.loads(res.stdout)["error"]["code"] == "UNKNOWN_REQUEST"
        assert res.stderr.startswith(f"unknown request id {unknown!r}: not queued")
        assert_short(res, 1)
        w, took = timed("watch", unknown, "--timeout-s", "60", env=traps.env)
        assert w.returncode == 4 and took < 30, (w.stderr, took)  # not the 60 s timeout
        assert w.stderr.startswith("unknown request id") and json.loads(w.stdout)["state"] == (
            "UNKNOWN"
        )


def test_a_producer_users_credentials_cannot_read_the_queues_and_say_so(traps: Traps) -> None:
    """The producer ACL user may not read queued messages (LRANGE, the unacked hash): with
    its credentials an id found nowhere is "not final yet", never called unknown."""
    password = (traps.run_dir / "redis-producer.password").read_text().strip()
    env = {**traps.env, "FLEET_REDIS__USER": "producer", "FLEET_REDIS__PASSWORD": password}
    res = fleet("result", str(uuid.uuid4()), env=env)
    assert res.returncode == 1, res.stderr
    assert json.loads(res.stdout)["where"] == "unsure"
    assert "these credentials cannot read the queues" in res.stderr
    assert_short(res, 1)


# -- 8: results later -------------------------------------------------------------------------
def test_result_and_watch_read_a_request_later(traps: Traps) -> None:
    sub = fleet("submit", "text", "--text", "A man is playing a guitar.", "--wait-s", "0",
                "--priority", "bulk", env=traps.env)  # fmt: skip
    assert sub.returncode == 0, sub.stderr
    task_id = json.loads(sub.stdout)["id"]
    assert f"fleet result {task_id}" in sub.stderr
    watch = fleet("watch", task_id, "--timeout-s", "60", env=traps.env)
    assert watch.returncode == 0, watch.stderr
    final = json.loads(watch.stdout.splitlines()[-1])
    assert final["state"] == "SUCCESS" and len(final["result"]["embedding"]) == 384
    res = fleet("result", task_id, env=traps.env)
    assert res.returncode == 0
    assert json.loads(res.stdout)["result"]["embedding"] == final["result"]["embedding"]


def test_failed_request_exits_1_and_refused_input_exits_2(traps: Traps) -> None:
    late = fleet("submit", "text", "--text", "Too late.", "--timeout-s", "0.0005",
                 env=traps.env)  # fmt: skip
    assert late.returncode == 1, late.stderr
    assert json.loads(late.stdout)["error"]["code"] == "DEADLINE_EXCEEDED"
    bad = fleet("submit", "raw", "text", "--inputs", '{"txt": "hi"}', env=traps.env)
    assert bad.returncode == 2
    assert json.loads(bad.stdout)["error"]["code"] == "INVALID_INPUT"


# -- 9: checks at the producer, help text ------------------------------------------------------
def test_inputs_are_checked_before_anything_is_sent(traps: Traps, tmp_path: Path) -> None:
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    proc = fleet("submit", "image", "--file", str(empty), env=traps.env)
    assert proc.returncode == 2
    err = json.loads(proc.stdout)["error"]
    assert err["code"] == "INVALID_INPUT" and "empty.png" in err["message"]
    assert "image_b64" not in err["message"]
    # Over [limits] max_text_chars: refused with Redis unreachable, so nothing was sent.
    closed = {**traps.env, "FLEET_REDIS__PORT": str(free_port())}
    big = fleet("submit", "text", "--text", "x " * 15000, env=closed)
    assert big.returncode == 2
    err = json.loads(big.stdout)["error"]
    assert err["code"] == "PAYLOAD_TOO_LARGE" and "max_text_chars" in err["message"]


def test_submit_text_reads_the_text_from_a_file_or_standard_input(
    traps: Traps, tmp_path: Path
) -> None:
    """``--text-file PATH`` (``-``: standard input) for a text the command line cannot carry
    (its length is bounded by the shell's argument limit): the same embedding as ``--text``;
    exactly one of the two, else a coded refusal before anything is sent."""
    import numpy as np

    text = "A man is playing a guitar in the park. " * 450  # 17,550 characters
    path = tmp_path / "long.txt"
    path.write_text(text, encoding="utf-8")
    stdin = subprocess.run(
        [sys.executable, "-m", "producer.cli", "submit", "text", "--text-file", "-"],
        input=text, capture_output=True, text=True, env=traps.env, timeout=120,
    )  # fmt: skip
    runs = [fleet("submit", "text", "--text-file", str(path), env=traps.env), stdin,
            fleet("submit", "text", "--text", text, env=traps.env)]  # fmt: skip
    embeddings = []
    for proc in runs:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        result = json.loads(proc.stdout)["result"]
        assert result["truncated"] is True and len(result["embedding"]) == 384
        embeddings.append(np.asarray(result["embedding"], dtype=np.float32))
    for other in embeddings[1:]:
        np.testing.assert_allclose(other, embeddings[0], atol=1e-4)

    # refused before Redis is asked (it is unreachable here): nothing was sent
    closed = {**traps.env, "FLEET_REDIS__PORT": str(free_port())}
    huge = tmp_path / "huge.txt"
    huge.write_bytes(b"x" * (1 << 20))
    missing = tmp_path / "missing.txt"
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9".encode("latin-1"))
    cases = [
        (["--text", "hi", "--text-file", str(path)], "INVALID_INPUT", "got both"),
        ([], "INVALID_INPUT", "got neither"),
        (["--text-file", str(missing)], "INVALID_INPUT", "missing.txt"),
        (["--text-file", str(latin1)], "INVALID_INPUT", "is not UTF-8 text"),
        (["--text-file", str(huge)], "PAYLOAD_TOO_LARGE", "max_text_chars"),
    ]
    for args, code, says in cases:
        proc = fleet("submit", "text", *args, env=closed)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        err = json.loads(proc.stdout)["error"]
        assert err["code"] == code and says in err["message"], (args, err)
        assert "Traceback" not in proc.stderr


def test_a_decompression_bomb_names_our_setting_and_the_worker_keeps_serving(
    traps: Traps, tmp_path: Path
) -> None:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("P", (1, 1)).save(buf, "GIF")
    data = bytearray(buf.getvalue())
    data[6:10] = (20000).to_bytes(2, "little") * 2  # the header claims 20000x20000
    bomb = tmp_path / "bomb.gif"
    bomb.write_bytes(bytes(data))
    proc = fleet("submit", "image", "--file", str(bomb), env=traps.env)
    assert proc.returncode == 2, proc.stderr
    err = json.loads(proc.stdout)["error"]
    assert err["code"] == "PAYLOAD_TOO_LARGE"
    assert "400,000,000 pixels" in err["message"]
    assert "[limits] max_image_pixels = 40,000,000" in err["message"]
    assert str(2 * Image.MAX_IMAGE_PIXELS) not in err["message"].replace(",", "")
    ok = fleet("submit", "image", "--file", str(DATA / "images" / "skimage_coffee.png"),
               env=traps.env)  # fmt: skip
    assert ok.returncode == 0, ok.stderr


def test_shm_help_is_plain_text() -> None:
    proc = fleet("shm", "--help", env=base_env())
    assert proc.returncode == 0
    assert "``" not in proc.stdout
    lines = [ln.strip() for ln in proc.stdout.splitlines()]
    assert not any(ln in ("(or", "files kept") for ln in lines), proc.stdout


# -- 4: a taken port; 6: a model override and a failed start's log ---------------------------
def test_port_in_use_fails_fast_naming_the_port_and_the_setting(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = base_env(
            FLEET_STACK__RUN_DIR=str(tmp_path / "run"),
            FLEET_REDIS__PORT=str(free_port()),
            FLEET_FLOWER__PORT=str(port),
        )
        t0 = time.monotonic()
        proc = fleet("up", "--modalities", "text", "--no-gateway", env=env)
        assert time.monotonic() - t0 < 10.0
    assert proc.returncode == 3, proc.stderr
    assert f"port {port} on 127.0.0.1 is already in use (needed by Flower)" in proc.stderr
    assert "FLEET_FLOWER__PORT=<port> fleet up" in proc.stderr
    assert_short(proc, 1)
    assert not list((tmp_path / "run" / "pids").glob("*.pid"))  # nothing was started


def test_model_override_by_env_reaches_the_worker_and_a_failed_start_is_one_cause(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "worker-image.log").write_text("STALE LINE FROM AN EARLIER RUN\n" * 40)
    missing = tmp_path / "no-such-weights"
    env = base_env(
        FLEET_STACK__RUN_DIR=str(run),
        FLEET_REDIS__PORT=str(free_port()),
        FLEET_METRICS__PORT_BASE="0",
        # `-` in a model name is `_` in a variable name
        FLEET_MODELS__EFFICIENTNET_LITE0__CHECKPOINT=str(missing),
    )
    proc = fleet("up", "--modalities", "image", "--no-flower", "--no-gateway", env=env,
                 timeout=200)  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    assert_short(proc)
    assert "worker image exited during start-up" in proc.stderr
    assert str(missing) in proc.stderr and "STALE" not in proc.stderr
    assert str(run / "logs" / "worker-image.log") in proc.stderr
    assert not [p for p in (run / "pids").glob("*.pid")]  # what was started is stopped


# -- 5: the demo beside a user's stack ------------------------------------------------------
def test_the_demo_runs_on_its_own_stack_and_leaves_the_users_running(traps: Traps) -> None:
    """``fleet demo`` (the README's main command) with the user's run dir in its environment:
    it succeeds, and afterwards every process of the user's stack still runs with the same
    pid and the user's Redis still answers with the same data."""
    pidfiles = sorted((traps.run_dir / "pids").glob("*.pid"))
    before = {p.stem: int(p.read_text()) for p in pidfiles}
    submit = fleet("submit", "text", "--text", "before the demo", env=traps.env)
    assert submit.returncode == 0, submit.stderr
    task_id = json.loads(submit.stdout)["id"]
    demo = fleet("demo", env=traps.env, timeout=900)
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    assert "valid: " in demo.stdout and "semantic check: PASSED" in demo.stdout
    after = {p.stem: int(p.read_text()) for p in sorted((traps.run_dir / "pids").glob("*.pid"))}
    assert after == before and all(running(pid) for pid in before.values())
    res = fleet("result", task_id, env=traps.env)  # the user's Redis, its data kept
    assert res.returncode == 0 and json.loads(res.stdout)["state"] == "SUCCESS", res.stdout


# -- a failed start beside a running stack -----------------------------------------------------
def test_a_worker_that_fails_to_start_leaves_the_running_stack_up(
    traps: Traps, tmp_path: Path
) -> None:
    """`fleet up --modalities video` with a bad checkpoint on the user's running stack: the
    video worker's failure is reported, and only what this command started is stopped (all
    of the stack was, before)."""
    before = {p.stem: int(p.read_text()) for p in (traps.run_dir / "pids").glob("*.pid")}
    env = {
        **traps.env,
        "FLEET_MODELS__VIDEO_EFFICIENTNET_LITE0__CHECKPOINT": str(tmp_path / "none"),
    }
    up = fleet("up", "--modalities", "video", "--no-gateway", env=env, timeout=400)
    assert up.returncode == 3, up.stderr
    assert "worker video exited during start-up" in up.stderr
    after = {p.stem: int(p.read_text()) for p in (traps.run_dir / "pids").glob("*.pid")}
    assert after == before and all(running(pid) for pid in before.values())
    st = fleet("status", env=traps.env)
    assert st.returncode == 0, st.stderr


# -- 2b: a part down --------------------------------------------------------------------------
def test_status_exits_3_and_names_a_replica_that_died(traps: Traps) -> None:
    # Last in this module: kills this module's own replica (its pid from our pidfile).
    os.kill(traps.pid("worker-text-1"), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while running(traps.pid("worker-text-1")) and time.monotonic() < deadline:
        time.sleep(0.1)
    proc = fleet("status", env=traps.env)
    assert proc.returncode == 3
    status = json.loads(proc.stdout)
    assert status["processes"]["worker-text-1"] is False
    # At once, not once its heartbeat is older than lease_s: the process is gone.
    assert status["live_workers"]["text"] == [f"text@{HOST}"]
    assert status["dead_workers"] == [f"text-1@{HOST}"]
    assert proc.stderr.startswith("down: worker-text-1 ")
    assert_short(proc, 1)
    # The README's fix, from a shell with only the run dir: the restarted replica finds the
    # stack's Redis through stack.json (it tried the default port before, and never answered).
    up = fleet("up", "--modalities", "text,image", "--replicas", "text=2", "--no-gateway",
               env=traps.env, timeout=400)  # fmt: skip
    assert up.returncode == 0, up.stderr
    assert "started worker-text-1" in up.stdout
    st = fleet("status", env=traps.env)
    assert st.returncode == 0, st.stderr
    assert json.loads(st.stdout)["live_workers"]["text"] == sorted([f"text@{HOST}",
                                                                    f"text-1@{HOST}"])  # fmt: skip
    again = fleet("up", "--modalities", "text,image", "--replicas", "text=2", "--no-gateway",
                  env=traps.env)  # fmt: skip
    assert again.returncode == 0, again.stderr
    already = "nothing to start: already running: exporter, flower, redis, worker-image"
    assert already in again.stdout, again.stdout
    # A model override for workers that already run does not reach them: said, not silent.
    override = {**traps.env, "FLEET_MODELS__MINILM__CHECKPOINT": "/weights/minilm"}
    kept = fleet("up", "--modalities", "text", "--no-gateway", "--no-flower", env=override)
    assert kept.returncode == 0, kept.stderr
    assert kept.stderr.startswith("warning: running workers keep the configuration they started "
                                  "with (worker-image, worker-text, worker-text-1)")  # fmt: skip
    assert "FLEET_MODELS__MINILM__CHECKPOINT applies to workers started now only" in kept.stderr

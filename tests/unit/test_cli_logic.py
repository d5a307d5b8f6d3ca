"""Pure logic behind the ``fleet`` CLI: run-dir discovery, model names in
environment variables, replica names and ports, exit codes, recorded stack addresses, the
broker diagnosis wording and a log tail that starts at this start. No servers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from producer.cli.base import ExitCode, exit_code_for, recorded_overrides
from producer.cli.diagnose import AUTH, NOT_STARTED, REFUSED, broker_message, classify
from producer.cli.output import jsonable
from producer.stack.local import (
    Stack,
    parse_replicas,
    port_in_use,
    port_problem,
    replica_metrics_base,
    replica_metrics_port,
)
from shared.settings import load_settings, locate_run_dir, merge_model_aliases, user_run_dir

REPO = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("no_fleet_env")  # FLEET_* from the shell must not leak in


# -- run dir discovery ------------------------------------------------------------------------
def make_project(root: Path) -> Path:
    (root / "configs").mkdir(parents=True)
    (root / "configs" / "fleet.toml").write_text("")
    (root / "pyproject.toml").write_text("")
    return root


def test_explicit_run_dir_is_relative_to_the_current_directory(tmp_path: Path) -> None:
    got = locate_run_dir(Path("r"), explicit=True, cwd=tmp_path, package_root=tmp_path,
                         user_dir=tmp_path / "u")  # fmt: skip
    assert got == (tmp_path / "r", "set by FLEET_STACK__RUN_DIR")


def test_default_run_dir_is_in_the_nearest_project_root_above(tmp_path: Path) -> None:
    proj = make_project(tmp_path / "proj")
    deep = proj / "a" / "b"
    deep.mkdir(parents=True)
    got = locate_run_dir(Path(".run"), explicit=False, cwd=deep, package_root=tmp_path / "x",
                         user_dir=tmp_path / "u")  # fmt: skip
    assert got == (proj / ".run", f"in the project root {proj}")


def test_outside_any_project_the_package_checkout_then_the_user_dir(tmp_path: Path) -> None:
    pkg = make_project(tmp_path / "pkg")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    got = locate_run_dir(Path(".run"), explicit=False, cwd=elsewhere, package_root=pkg,
                         user_dir=tmp_path / "u")  # fmt: skip
    assert got[0] == pkg / ".run"
    not_a_checkout = tmp_path / "site-packages"
    not_a_checkout.mkdir()
    got = locate_run_dir(Path(".run"), explicit=False, cwd=elsewhere,
                         package_root=not_a_checkout, user_dir=tmp_path / "u")  # fmt: skip
    assert got == (tmp_path / "u", "the per-user location (no project checkout found)")


def test_absolute_configured_run_dir_is_used_as_is(tmp_path: Path) -> None:
    got = locate_run_dir(tmp_path / "abs", explicit=False, cwd=Path("/"), package_root=tmp_path,
                         user_dir=tmp_path / "u")  # fmt: skip
    assert got == (tmp_path / "abs", "set by [stack] run_dir in the config")


def test_user_run_dir_follows_xdg_state_home() -> None:
    assert user_run_dir({"XDG_STATE_HOME": "/s"}) == Path("/s/mmfleet/run")
    assert user_run_dir({"HOME": "/h"}) == Path("/h/.local/state/mmfleet/run")


def test_fleet_runs_from_outside_the_checkout(tmp_path: Path) -> None:
    # The editable install's source tree is the project root: no FileNotFoundError.
    code = "from shared.settings import load_settings as l; s = l(); print(s.run_dir_source)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, env={"PATH": os.environ["PATH"]}, check=True)  # fmt: skip
    assert out.stdout.strip() == f"in the project root {REPO}"


# -- model names in environment variables -----------------------------------------------------
def test_env_model_name_with_underscores_overrides_the_dashed_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLEET_MODELS__RESNET18_RANDOM__CHECKPOINT", "/weights/resnet")
    s = load_settings()
    assert s.models["resnet18-random"].checkpoint == "/weights/resnet"  # type: ignore[attr-defined]
    assert s.models["resnet18-random"].kind == "resnet"
    assert "resnet18_random" not in s.models
    assert s.models["video-efficientnet-lite0"].checkpoint == ""  # type: ignore[attr-defined]


def test_model_override_of_no_configured_model_is_refused_with_the_rule() -> None:
    with pytest.raises(ValueError, match=r"names no configured model.*'_' for '-'"):
        merge_model_aliases({"minilm": {"kind": "minilm"}, "mini_lm": {"x": 1}})


def test_model_override_merges_nested_keys_and_wins() -> None:
    got = merge_model_aliases(
        {"a-b": {"kind": "k", "opts": {"x": 1, "y": 2}}, "A_B": {"opts": {"y": 3}}}
    )
    assert got == {"a-b": {"kind": "k", "opts": {"x": 1, "y": 3}}}


# -- replicas and ports -----------------------------------------------------------------------
def test_parse_replicas() -> None:
    assert parse_replicas("text=2,image=1") == {"text": 2, "image": 1}
    assert parse_replicas("video") == {"video": 1}
    assert parse_replicas("") == {}
    unknown = "unknown modality 'audio' in --replicas; expected <modality>=<count> with a mod"
    for bad, msg in (("audio=2", unknown), ("text=x", "integer"),
                     ("text=0", "1 to 16"), ("text=1,text=2", "twice")):  # fmt: skip
        with pytest.raises(ValueError, match=msg):
            parse_replicas(bad)


def test_replica_ports_are_distinct_and_replica_0_keeps_todays_ports() -> None:
    ports = {
        (m, i): replica_metrics_port(9101, m, i)
        for m in ("text", "image", "video", "xmodal")
        for i in range(3)
    }
    assert len(set(ports.values())) == len(ports)
    assert [ports[(m, 0)] for m in ("text", "image", "video", "xmodal")] == [9101, 9102, 9103, 9104]
    assert ports[("text", 1)] == 9105 and ports[("image", 1)] == 9106
    # the replica's own process computes base + modality index from its shifted base
    assert replica_metrics_base(9101, 1) + 1 == ports[("image", 1)]
    assert replica_metrics_port(0, "text", 3) is None and replica_metrics_base(0, 3) == 0


def test_planned_workers_and_names() -> None:
    assert Stack.planned_workers(["text", "image"], {"text": 2}) == [
        ("text", 0), ("text", 1), ("image", 0),
    ]  # fmt: skip
    assert Stack.planned_workers(["text"], {"video": 1}) == [("text", 0), ("video", 0)]
    assert [Stack.worker_name("text", i) for i in (0, 1)] == ["worker-text", "worker-text-1"]


def test_port_problem_names_the_port_and_the_setting() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert port_in_use("127.0.0.1", port)
        msg = port_problem([("flower", "127.0.0.1", port, "Flower", "FLEET_FLOWER__PORT")])
    assert msg is not None and f"port {port} on 127.0.0.1 is already in use" in msg
    assert "FLEET_FLOWER__PORT=<port> fleet up (or --no-flower)" in msg
    twice = port_problem([("a", "127.0.0.1", 1, "Redis", "FLEET_REDIS__PORT"),
                          ("b", "127.0.0.1", 1, "Flower", "FLEET_FLOWER__PORT")])  # fmt: skip
    assert twice is not None and "planned twice" in twice


# -- exit codes and messages ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("code", "exit_code"),
    [("INVALID_INPUT", 2), ("PAYLOAD_TOO_LARGE", 2), ("IMAGE_DECODE", 2),
     ("UNSUPPORTED_MODALITY", 2), ("DEADLINE_EXCEEDED", 1), ("MODEL_ERROR", 1),
     ("QUEUE_FULL", 1), ("WAIT_TIMEOUT", 1), ("REVOKED", 1), ("NO_READY_WORKER", 3),
     ("SOMETHING_NEW", 1)],
)  # fmt: skip
def test_exit_code_for(code: str, exit_code: int) -> None:
    assert exit_code_for(code) == exit_code


def test_exit_codes_are_the_documented_ones() -> None:
    assert [int(c) for c in ExitCode] == [0, 1, 2, 3, 4]
    table = (REPO / "docs" / "cli.md").read_text()  # the README links to it (Exit codes)
    for line in ("| 0 |", "| 1 |", "| 2 |", "| 3 |", "| 4 |"):
        assert line in table
    assert "docs/cli.md#exit-codes" in (REPO / "README.md").read_text()


def test_recorded_addresses_yield_to_the_environment() -> None:
    state = {"flower": {"host": "127.0.0.1", "port": 5556}, "redis": {"port": 6400}}
    got = recorded_overrides(state, {"FLEET_REDIS__PORT": "7000"})
    assert got == {"flower": {"host": "127.0.0.1", "port": 5556}}


def test_broker_messages_name_cause_and_fix() -> None:
    facts = {"address": "127.0.0.1:6390", "run_dir": "/r", "run_dir_from": "in the project root /"}
    auth = broker_message(AUTH, user="producer", password_from="FLEET_REDIS__PASSWORD", **facts)
    assert "authentication failed" in auth and "password in FLEET_REDIS__PASSWORD" in auth
    assert len(auth.splitlines()) == 2
    refused = broker_message(REFUSED, redis_pid_alive=False, **facts)
    assert "connection refused" in refused and "logs/redis.log" in refused
    assert "make up" in broker_message(NOT_STARTED, **facts)


def test_classify_redis_failures() -> None:
    import redis

    assert classify(redis.AuthenticationError("invalid username-password pair")) == AUTH
    assert classify(redis.ConnectionError("Error 111 connecting. Connection refused.")) == REFUSED
    from kombu.exceptions import OperationalError

    wrapped = OperationalError("x")
    wrapped.__cause__ = redis.ResponseError("WRONGPASS invalid username-password pair")
    assert classify(wrapped) == AUTH


def test_tensor_refs_print_as_shapes() -> None:
    ref = {"kind": "shm", "id": "t" + "0" * 32, "shape": [8, 512], "dtype": "float32",
           "nbytes": 16384, "owner": "worker:h:1", "created_at": 0.0, "ttl_s": 600.0}  # fmt: skip
    assert jsonable({"frame_embeddings": ref, "n": 1}, full=False) == {
        "frame_embeddings": {"shape": [8, 512], "dtype": "float32"},
        "n": 1,
    }


# -- a failed start shows this start's log only ----------------------------------------------
def test_log_tail_starts_at_this_start(tmp_path: Path) -> None:
    st = Stack(load_settings(stack={"run_dir": tmp_path}))
    st.prepare()
    (st.logs / "probe.log").write_text("STALE\n" * 50)
    proc = st._spawn("probe", ["sh", "-c", "echo fresh line"])
    deadline = time.monotonic() + 10
    while st.alive(proc.name) and time.monotonic() < deadline:
        time.sleep(0.02)
    st.stop("probe")
    assert st.log_tail("probe") == "fresh line"


# -- where a request is (fleet result / watch of an id without a result) ----------------------
def kombu_message(task_id: str, text: str = "hello") -> dict[str, object]:
    import base64
    import json

    body = base64.b64encode(json.dumps([[], {"inputs": {"text": text}}, {}]).encode()).decode()
    return {"body": body, "headers": {"id": task_id, "task": "fleet.text"},
            "properties": {"delivery_tag": "t-1"}}  # fmt: skip


def test_a_message_matches_on_its_header_id_not_on_an_input_holding_the_id() -> None:
    import json

    from producer.cli.locate import message_id, unacked_entry_match

    wanted = "5b0e5c0e-0000-4000-8000-000000000001"
    other = kombu_message("5b0e5c0e-0000-4000-8000-000000000002", text=f"see {wanted}")
    assert message_id(json.dumps(kombu_message(wanted)).encode()) == wanted
    assert message_id(json.dumps(other)) != wanted
    assert message_id(b"not json") is None and message_id({"headers": "x"}) is None
    entry = json.dumps([kombu_message(wanted), "", "text.realtime"]).encode()
    assert unacked_entry_match(entry, wanted) == "text.realtime"
    other_entry = json.dumps([other, "", "text"]).encode()
    assert unacked_entry_match(other_entry, wanted) is None  # the id is only in its input
    assert unacked_entry_match(b"[broken", wanted) is None


def test_queue_position_counts_earlier_steps_and_the_messages_nearer_the_tail() -> None:
    from producer.cli.locate import queue_position

    # Workers take step 0 first, each list from its tail (the oldest message).
    assert queue_position([0, 0, 3], step=2, index_from_head=2) == 1  # at the tail: next
    assert queue_position([0, 0, 3], step=2, index_from_head=0) == 3  # newest: last
    assert queue_position([2, 0, 3], step=2, index_from_head=2) == 3  # 2 of step 0 first


def test_location_words_and_json() -> None:
    from producer.cli.locate import HELD, QUEUED, UNSURE, Location

    q = Location(QUEUED, "video", position=2, queued=5)
    assert q.to_dict() == {"where": "queued", "queue": "video", "position": 2, "queued": 5}
    assert q.words() == "queued, position 2 of 5 in queue 'video'"
    assert Location(HELD, "text").to_dict() == {"where": "held", "queue": "text"}
    assert "cannot read the queues" in Location(UNSURE).words()


def test_negative_or_infinite_seconds_are_refused_in_one_line() -> None:
    from producer.cli.base import CliProblem, check_seconds

    check_seconds("--wait-s", 0.0)
    for value, positive in ((-1.0, False), (float("inf"), False), (0.0, True)):
        with pytest.raises(CliProblem) as info:
            check_seconds("--wait-s", value, positive=positive)
        assert info.value.exit_code == ExitCode.REFUSED
        assert info.value.message.startswith("--wait-s must be ")
        assert "\n" not in info.value.message


def test_dead_worker_nodes_are_the_local_workers_whose_pid_is_gone(tmp_path: Path) -> None:
    import socket

    s = load_settings(stack={"run_dir": str(tmp_path / "run")})
    stack = Stack(s)
    stack.pids.mkdir(parents=True, exist_ok=True)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (stack.pids / "worker-text-1.pid").write_text(str(gone.pid))
    (stack.pids / "worker-text.pid").write_text(str(os.getpid()))  # alive
    (stack.pids / "redis.pid").write_text(str(gone.pid))  # not a worker
    assert stack.dead_worker_nodes() == {f"text-1@{socket.gethostname()}"}


def test_cli_probes_do_not_retry_and_connect_with_a_short_timeout() -> None:
    from producer.cli.diagnose import probe_client

    client = probe_client(load_settings(), None, "x")
    kwargs = client.connection_pool.connection_kwargs
    assert kwargs["socket_connect_timeout"] < 1.0
    assert client.get_retry().get_retries() == 0  # redis-py's default retries for seconds
    client.close()


def test_processes_a_stack_starts_get_its_recorded_addresses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A worker added by a later `fleet up` from a shell without the stack's FLEET_* values
    # must reach the stack's Redis, not the default port.
    s = load_settings(stack={"run_dir": str(tmp_path)}, redis={"port": 6401},
                      flower={"port": 5601})  # fmt: skip
    env = Stack(s).env()
    assert env["FLEET_REDIS__PORT"] == "6401" and env["FLEET_FLOWER__PORT"] == "5601"
    assert env["FLEET_STACK__RUN_DIR"] == str(tmp_path)
    monkeypatch.setenv("FLEET_REDIS__PORT", "7000")  # the caller's own setting wins
    assert Stack(s).env()["FLEET_REDIS__PORT"] == "7000"


@pytest.mark.parametrize("command", ["result", "watch"])
@pytest.mark.parametrize("given", ["", "  ", "\n"])
def test_an_empty_id_is_refused_as_input_without_a_traceback(command: str, given: str) -> None:
    # What `fleet result "$ID"` gets when the line that set ID failed: a coded refusal
    # (exit 2), before any connection is made, never a traceback.
    from typer.testing import CliRunner

    from producer.cli import app

    out = CliRunner().invoke(app, [command, given])
    assert out.exit_code == 2, out.output
    assert out.exception is None or isinstance(out.exception, SystemExit)
    assert json.loads(out.stdout.splitlines()[0])["error"]["code"] == "INVALID_INPUT"
    assert "Traceback" not in out.output


def test_redis_url_prints_the_role_url_of_the_run_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What a Celery client of another language connects with (README: Celery-native
    # producers): the producer's password file and the stack's port.
    from typer.testing import CliRunner

    from producer.cli import app

    monkeypatch.setenv("FLEET_STACK__RUN_DIR", str(tmp_path))
    (tmp_path / "redis-producer.password").write_text("pr0d-pw\n")
    monkeypatch.setenv("FLEET_REDIS__PORT", "6411")
    out = CliRunner().invoke(app, ["redis-url"])
    assert out.exit_code == 0, out.output
    assert out.stdout.strip() == "redis://producer:pr0d-pw@127.0.0.1:6411/0"
    worker = CliRunner().invoke(app, ["redis-url", "worker"])  # no file: no stack there
    assert worker.exit_code == 3 and "no redis-worker.password in" in worker.output
    guest = CliRunner().invoke(app, ["redis-url", "guest"])
    assert guest.exit_code == 2 and "unknown Redis role 'guest'" in guest.output

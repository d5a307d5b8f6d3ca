"""The README's first-hour commands and its Python snippet, run exactly as written.

Blocks marked ``<!-- doctest: NAME -->`` in README.md run in order on one stack: the quick
start (``make up``, ``fleet status``, two submits), *Running the stack by hand* (a second text
replica, results read later, ``fleet watch``), *From Python*, then ``make down``. Each shell
block runs under ``bash -e`` from the repository root, so any command exiting non-zero fails
it. Only the environment differs from a user's shell: the stack's run dir, ports and /dev/shm
root are this test's own (``FLEET_*`` variables the README's commands honour), so a user's
``make up`` stack is never touched; and ``make`` is told the venv is installed already
(``-o .venv/.installed``: rebuilding the venv under test is ``make venv``'s job).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from producer.stack import free_port
from tests.conftest import free_port_block

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
HOST = socket.gethostname()


def doctest_blocks(text: str) -> dict[str, tuple[str, str]]:
    """``{name: (language, code)}`` of every fenced block right after a doctest marker."""
    pattern = re.compile(r"<!-- doctest: ([\w-]+) -->\n```(\w+)\n(.*?)\n```", re.S)
    return {m[1]: (m[2], m[3]) for m in pattern.finditer(text)}


BLOCKS = doctest_blocks(README.read_text())


class Shell:
    def __init__(self, env: dict[str, str]) -> None:
        self.env = env

    def run(self, name: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
        lang, code = BLOCKS[name]
        argv = ["bash", "-e", "-c", code] if lang == "sh" else [str(REPO / ".venv/bin/python")]
        proc = subprocess.run(
            argv, input=code if lang == "python" else None, capture_output=True, text=True,
            cwd=REPO, env=self.env, timeout=timeout,
        )  # fmt: skip
        assert proc.returncode == 0, f"README block {name!r} failed:\n{proc.stdout}\n{proc.stderr}"
        return proc


@pytest.fixture(scope="module")
def shell(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shell]:
    tmp = tmp_path_factory.mktemp("readme")
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    real_make = shutil.which("make")
    assert real_make, "make is needed to run the README's commands"
    (bin_dir / "make").write_text(f'#!/bin/sh\nexec {real_make} -o .venv/.installed "$@"\n')
    (bin_dir / "make").chmod(0o755)
    shm_root = Path("/dev/shm") / f"mmfleet-test-readme-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("FLEET_")}
    env.update(
        PATH=f"{bin_dir}:{env['PATH']}",
        FLEET_STACK__RUN_DIR=str(tmp / "run"),
        FLEET_REDIS__PORT=str(free_port()),
        FLEET_FLOWER__PORT=str(free_port()),
        FLEET_GATEWAY__PORT=str(free_port()),
        FLEET_METRICS__PORT_BASE=str(free_port_block(8)),
        FLEET_METRICS__EXPORTER_PORT=str(free_port()),
        FLEET_TRANSPORT__SHM_ROOT=str(shm_root),
        FLEET_MODALITIES__TEXT__BATCHING__MAX_BATCH_SIZE="16",  # a shorter warmup
        FLEET_MODALITIES__IMAGE__BATCHING__MAX_BATCH_SIZE="4",
    )
    sh = Shell(env)
    try:
        yield sh
    finally:
        pids = [int(p.read_text()) for p in (tmp / "run" / "pids").glob("*.pid")]
        subprocess.run([str(REPO / ".venv/bin/fleet"), "down"], env=env, cwd=REPO,
                       capture_output=True, timeout=120)  # fmt: skip
        shutil.rmtree(shm_root, ignore_errors=True)
        left = [p for p in pids if Path(f"/proc/{p}").exists()]
        assert not left, f"processes left after make down: {left}"


def test_readme_marks_the_blocks_this_test_runs() -> None:
    assert list(BLOCKS) == ["quick-start", "down", "by-hand", "python"]


def test_readme_first_hour_runs_as_written(shell: Shell) -> None:
    quick = shell.run("quick-start")
    lines = [json.loads(ln) for ln in quick.stdout.splitlines() if ln.startswith("{")]
    status, text, image = lines
    assert status["live_workers"] == {"image": [f"image@{HOST}"], "text": [f"text@{HOST}"]}
    assert len(text["result"]["embedding"]) == 384
    assert len(image["result"]["embedding"]) == 512

    by_hand = shell.run("by-hand")
    out = [json.loads(ln) for ln in by_hand.stdout.splitlines() if ln.startswith("{")]
    status = next(o for o in out if "live_workers" in o)
    assert status["live_workers"]["text"] == sorted([f"text@{HOST}", f"text-1@{HOST}"])
    assert status["processes"]["worker-text-1"] is True
    finals = [o for o in out if o.get("state") == "SUCCESS"]
    assert len(finals) == 2 and finals[0]["id"] == finals[1]["id"]  # watch, then result
    assert "url:" in by_hand.stdout  # make flower

    py = shell.run("python")
    dim_text, dim_image, live = py.stdout.splitlines()
    assert (dim_text, dim_image) == ("384", "512")
    assert f"text-1@{HOST}" in live

    shell.run("down")
    run_dir = Path(shell.env["FLEET_STACK__RUN_DIR"])
    assert not list((run_dir / "pids").glob("*.pid"))

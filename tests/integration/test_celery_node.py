"""A Node.js producer: the real celery-node client from npm, with its default options, as the
``producer`` Redis user (least privilege, ``shared.acl``) on the session stack.

celery-node 0.5.x connects with ioredis 4, which sends ``INFO`` as its ready check and reads
the user name from a URL only with ``?allowUsernameInURI=true``: the URL the README gives for
it. The client is installed from the npm registry into ``build/node/`` (gitignored, reused
by later runs); without ``node`` and ``npm`` on PATH the tests are skipped.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CELERY_NODE = "0.5.9"
NODE_DIR = REPO / "build" / "node" / f"celery-node-{CELERY_NODE}"
PRODUCER_JS = HERE / "celery_node_producer.js"
JOBS = 40


@pytest.fixture(scope="module")
def node_modules() -> Path:
    """celery-node, installed once into ``build/node/`` (a lock keeps two runs apart)."""
    npm = shutil.which("npm")
    if not shutil.which("node") or not npm:
        pytest.skip("node and npm are not on PATH (Debian: apt-get install nodejs npm)")
    NODE_DIR.mkdir(parents=True, exist_ok=True)
    installed = NODE_DIR / "node_modules" / "celery-node" / "package.json"
    with (NODE_DIR / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not installed.exists() or json.loads(installed.read_text())["version"] != CELERY_NODE:
            spec = f"celery-node@{CELERY_NODE}"
            argv = [npm, "install", "--no-audit", "--no-fund", "--prefix", str(NODE_DIR), spec]
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, f"npm install {spec} failed:\n{proc.stderr[-3000:]}"
    return NODE_DIR / "node_modules"


def celery_node_url() -> str:
    """The URL the README gives celery-node: ``fleet redis-url`` (the producer's, found in the
    stack's run dir, which the session's FLEET_* variables name) with ioredis 4's switch."""
    fleet = [sys.executable, "-m", "producer.cli", "redis-url"]
    proc = subprocess.run(fleet, capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    url = proc.stdout.strip()
    assert url.startswith("redis://producer:"), url
    return url + "?allowUsernameInURI=true"


def readme_js() -> str:
    """The README's celery-node example (its one ``js`` block)."""
    blocks = re.findall(r"^```js\n(.*?)^```$", (REPO / "README.md").read_text(), re.M | re.S)
    assert len(blocks) == 1, "README.md has one js block: the celery-node example"
    return blocks[0]


def run_node(
    node_modules: Path, script: Path, env: dict[str, str], timeout_s: float = 180
) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ, NODE_PATH=str(node_modules), **env)
    return subprocess.run(
        ["node", str(script)], capture_output=True, text=True, env=full, timeout=timeout_s
    )


def test_celery_node_with_default_options_produces_as_the_producer_user(
    stack: Any, node_modules: Path
) -> None:
    admin = redis.Redis.from_url(stack.s.redis_url("admin"), socket_timeout=5)
    admin.execute_command("ACL", "LOG", "RESET")
    proc = run_node(
        node_modules,
        PRODUCER_JS,
        {"FLEET_PRODUCER_URL": celery_node_url(), "JOBS": str(JOBS)},
    )
    denied = admin.execute_command("ACL", "LOG", "20")
    assert proc.returncode == 0, f"celery-node failed:\n{proc.stderr[-3000:]}\nACL LOG: {denied}"
    outcomes = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(outcomes) == JOBS + 1
    good, bad = outcomes[:JOBS], outcomes[JOBS]
    assert all(o["status"] == "SUCCESS" for o in good), [o for o in good if "code" in o]
    assert {o["dim"] for o in good} == {384}  # MiniLM embeddings, unit norm
    assert all(abs(o["norm"] - 1.0) < 1e-3 for o in good)
    assert len({o["id"] for o in outcomes}) == JOBS + 1
    # the bad input's FAILURE result carries the fleet's stable code, read by celery-node
    assert (bad["status"], bad["code"], bad["exc_type"]) == (
        "FAILURE", "INVALID_INPUT", "InvalidInput",
    )  # fmt: skip
    # nothing the client sent (AUTH with the user, SELECT, INFO, LPUSH, GET, QUIT) was refused
    assert denied == [], denied


def test_the_readme_celery_node_example_runs_as_written(
    stack: Any, node_modules: Path, tmp_path: Path
) -> None:
    admin = redis.Redis.from_url(stack.s.redis_url("admin"), socket_timeout=5)
    admin.execute_command("ACL", "LOG", "RESET")
    script = tmp_path / "produce.js"
    script.write_text(readme_js())
    proc = run_node(node_modules, script, {"FLEET_PRODUCER_URL": celery_node_url()}, 60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "384", proc.stdout
    denied = admin.execute_command("ACL", "LOG", "20")
    assert denied == [], denied

"""The commands and snippets of the README and the documentation pages, run exactly as written.

Blocks marked ``<!-- doctest: NAME -->`` in README.md and in the pages under ``docs/`` (not
``docs/measurements/``) run in this order on one stack: the README's quick start (``make
up``, ``fleet status``, two submits), *Running the stack by hand* (a second text replica,
results read later, ``fleet watch``; then a video worker and a video), *From Python*, the
asyncio script of docs/clients.md, the README's *asyncio* FastAPI service (driven by its test
client), the gateway's curl examples (docs/gateway.md: health, metadata, a sync text, a binary
image, an async video polled, streamed and cancelled), then ``make down``; then *Real weights*
(docs/models.md: a folder saved with ``save_pretrained``, served by an image worker of a new
stack) and ``make down`` again.
Each shell block runs under ``bash -e`` from the repository root, so any command exiting
non-zero fails it. Only the environment differs from a user's shell: the stack's run dir,
ports and /dev/shm root are this test's own (``FLEET_*`` variables the README's commands
honour, the gateway's port in ``G`` included), so a user's ``make up`` stack is never
touched; and ``make`` is told the venv is installed already (``-o .venv/.installed``:
rebuilding the venv under test is ``make venv``'s job).

Not run here: ``make demo`` and ``make test`` (CI runs ``make test`` itself, and
``test_cli_traps`` runs the demo's ``fleet demo``).
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

from producer.stack.local import free_port
from shared.procs import running
from tests.conftest import free_port_block

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
HOST = socket.gethostname()
_MARKED = re.compile(r"<!-- doctest: ([\w-]+) -->\n```(\w+)\n(.*?)\n```", re.S)


def documents() -> list[Path]:
    """README.md, then the documentation pages (``docs/*.md``; the generated
    ``docs/measurements/`` pages hold no commands)."""
    return [README, *sorted((REPO / "docs").glob("*.md"))]


def doctest_blocks(paths: list[Path]) -> dict[str, tuple[str, str, str]]:
    """``{name: (language, code, file)}`` of every fenced block right after a doctest marker,
    in the order of ``paths`` and of each file.

    Raises:
        ValueError: two blocks share a name (the tests run blocks by name).
    """
    blocks: dict[str, tuple[str, str, str]] = {}
    for path in paths:
        for m in _MARKED.finditer(path.read_text()):
            if m[1] in blocks:
                raise ValueError(f"doctest block {m[1]!r} in {path} and {blocks[m[1]][2]}")
            blocks[m[1]] = (m[2], m[3], str(path.relative_to(REPO)))
    return blocks


BLOCKS = doctest_blocks(documents())


class Shell:
    def __init__(self, env: dict[str, str]) -> None:
        self.env = env

    def run(self, name: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
        lang, code, where = BLOCKS[name]
        argv = ["bash", "-e", "-c", code] if lang == "sh" else [str(REPO / ".venv/bin/python")]
        proc = subprocess.run(
            argv, input=code if lang == "python" else None, capture_output=True, text=True,
            cwd=REPO, env=self.env, timeout=timeout,
        )  # fmt: skip
        assert proc.returncode == 0, f"{where} block {name!r} failed:\n{proc.stdout}\n{proc.stderr}"
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
        left = [p for p in pids if running(p)]
        assert not left, f"processes left after make down: {left}"


def test_readme_marks_the_blocks_this_test_runs() -> None:
    where = {name: block[2] for name, block in BLOCKS.items()}
    assert where == {
        "quick-start": "README.md", "down": "README.md", "by-hand": "README.md",
        "video": "README.md", "python": "README.md", "fastapi": "README.md",
        "asyncio": "docs/clients.md", "gateway": "docs/gateway.md",
        "real-weights": "docs/models.md",
    }  # fmt: skip


def test_readme_first_hour_runs_as_written(shell: Shell) -> None:
    quick = shell.run("quick-start")
    lines = [json.loads(ln) for ln in quick.stdout.splitlines() if ln.startswith("{")]
    status, text, image = lines
    assert status["live_workers"] == {"image": [f"image@{HOST}"], "text": [f"text@{HOST}"]}
    assert len(text["result"]["embedding"]) == 384
    assert len(image["result"]["embedding"]) == 1280  # EfficientNet-Lite0

    by_hand = shell.run("by-hand")
    out = [json.loads(ln) for ln in by_hand.stdout.splitlines() if ln.startswith("{")]
    status = next(o for o in out if "live_workers" in o)
    assert status["live_workers"]["text"] == sorted([f"text@{HOST}", f"text-1@{HOST}"])
    assert status["processes"]["worker-text-1"] is True
    finals = [o for o in out if o.get("state") == "SUCCESS"]
    assert len(finals) == 2 and finals[0]["id"] == finals[1]["id"]  # watch, then result
    assert "url:" in by_hand.stdout  # make flower

    video = shell.run("video")
    assert "started worker-video" in video.stdout
    out = json.loads(video.stdout.splitlines()[-1])["result"]
    assert len(out["clip_embedding"]) == 1280 and out["partial"] is False
    assert out["frame_embeddings"] == {"shape": [out["frames"], 1280], "dtype": "float32"}

    py = shell.run("python")
    dim_text, dim_image, live = py.stdout.splitlines()
    assert (dim_text, dim_image) == ("384", "1280")
    assert f"text-1@{HOST}" in live

    assert shell.run("asyncio").stdout.splitlines() == ["384"]
    service = shell.run("fastapi")  # the README's service: one good and one refused request
    assert service.stdout.splitlines() == ["384", "INVALID_INPUT"]

    check_gateway_block(shell)

    shell.run("down")
    run_dir = Path(shell.env["FLEET_STACK__RUN_DIR"])
    assert not list((run_dir / "pids").glob("*.pid"))


def json_docs(text: str) -> list[object]:
    """The JSON documents of ``text``, written back to back (whitespace between allowed)."""
    decoder, docs, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        doc, i = decoder.raw_decode(text, i)
        docs.append(doc)
    return docs


def check_gateway_block(shell: Shell) -> None:
    """The curl block's outputs, in its order: health (empty body), the model's metadata, a
    sync text's inference response, the binary image (to /tmp/embedding.bin), then the async
    video: 202 with its Location, its job, its event stream to the end, and the cancel that
    comes after it is final (409)."""
    saved = Path("/tmp/embedding.bin")
    existed = saved.exists()
    try:
        out = shell.run("gateway").stdout
        head, _, rest = out.partition("HTTP/1.1 202")
        live, meta, text = json_docs(head)  # curl prints bodies back to back
        assert live == {"live": True}
        assert meta["name"] == "minilm"
        assert text["id"] == "t-1" and text["outputs"][0]["shape"] == [1, 384]
        # the binary reply: its JSON header, then 1,280 float32 (5,120 bytes)
        assert saved.stat().st_size > 5120 and saved.read_bytes().startswith(b"{")
        assert re.search(r"^location: /v2/jobs/v-1", rest, re.M | re.I), rest[:500]
        assert "event: state" in rest and "event: final" in rest
        final = json.loads(rest.split("event: final\ndata: ", 1)[1].splitlines()[0])
        assert final["id"] == "v-1" and final["state"] == "SUCCESS"
        assert rest.rstrip().splitlines()[-1].startswith("{"), rest[-300:]  # the DELETE's body
        assert "ALREADY_FINAL" in rest.rstrip().splitlines()[-1]
    finally:
        if not existed:
            saved.unlink(missing_ok=True)


def test_readme_real_weights_example_runs_offline(shell: Shell) -> None:
    """*Real weights*: a model saved with ``save_pretrained`` (no download), served by the
    image worker of a new stack, whose ready line names the folder."""
    folder = Path("/tmp/my-resnet")
    existed = folder.exists()
    try:
        shell.run("real-weights")
        run_dir = Path(shell.env["FLEET_STACK__RUN_DIR"])
        log = (run_dir / "logs" / "worker-image.log").read_text()
        ready = [ln for ln in log.splitlines() if "fleet worker ready" in ln]
        assert ready and "'weights': '/tmp/my-resnet'" in ready[-1], ready[-1:]
        ok = subprocess.run(
            [str(REPO / ".venv/bin/fleet"), "submit", "image", "--file",
             "data/images/skimage_coffee.png"],
            capture_output=True, text=True, cwd=REPO, env=shell.env, timeout=120,
        )  # fmt: skip
        assert ok.returncode == 0, ok.stderr
    finally:
        shell.run("down")
        if not existed:
            shutil.rmtree(folder, ignore_errors=True)

"""The client installed anywhere: the project's wheel, built from a copy of this checkout,
installed with its dependencies (from the package index pip is configured with, PyPI by
default) into a fresh venv outside the checkout, with no config file and no ``FLEET_*``
variable but the Redis URL, submits text and an image to the session stack's workers with
both clients.

Producers need no torch: the wheel's main dependencies do not pull it in (torch is the
``worker`` extra's), and the test holds the venv to that. The install takes about a minute
(most of it pip fetching and unpacking the dependencies), so the test is marked
``install``: ``make test`` runs it once, ``pytest -m "not install"`` leaves it out.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.install, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]
IMAGE = REPO / "data" / "images" / "skimage_coffee.png"

# What a checkout holds that is not the project's source (virtual envs, run dirs, builds).
NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv*", ".run", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
    ".ruff_cache", "reports", ".whl", ".gl",
)  # fmt: skip


@dataclass(frozen=True)
class Installed:
    python: Path  # the fresh venv's interpreter
    home: Path  # a directory outside the checkout, with no configs/
    timings_s: dict[str, float]


def _clean_env(home: Path, **extra: str) -> dict[str, str]:
    """The environment of a process outside the checkout: no ``FLEET_*``, no
    ``PYTHONPATH`` or ``VIRTUAL_ENV`` pointing back at it; pip's own settings kept."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.upper().startswith("FLEET_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")
    }
    env.update(HOME=str(home), XDG_STATE_HOME=str(home / ".state"), **extra)
    return env


def _run(argv: list[Any], cwd: Path, env: dict[str, str], timeout: float) -> str:
    proc = subprocess.run(
        [str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"{argv[:4]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    tmp = tmp_path_factory.mktemp("wheel")
    home = tmp / "elsewhere"
    home.mkdir()
    env = _clean_env(home)
    timings: dict[str, float] = {}

    started = time.monotonic()
    src = tmp / "src"  # a copy: a build writes build/ and *.egg-info beside the source
    shutil.copytree(REPO, src, symlinks=True, ignore=NOT_SOURCE)
    dist = tmp / "dist"
    # the build backend of this venv when it has one (else pip fetches it for the build)
    here = importlib.util.find_spec("setuptools") is not None
    # ``build`` the PyPA package, not a namespace: the checkout's own build/ (make docs
    # writes build/site) is one when the tests run from the repo root
    build = importlib.util.find_spec("build")
    if build is not None and build.origin not in (None, "namespace"):
        argv = [sys.executable, "-m", "build", "--wheel", "--outdir", dist, src]
        argv += ["--no-isolation"] if here else []
    else:
        argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", dist, src]
        argv += ["--no-build-isolation"] if here else []
    _run(argv, tmp, env, 600)
    (wheel,) = dist.glob("mmfleet-*.whl")
    timings["build_s"] = time.monotonic() - started

    started = time.monotonic()
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", venv], tmp, env, 300)
    python = venv / "bin" / "python"
    _run([python, "-m", "pip", "install", "-q", wheel], tmp, env, 900)
    timings["install_s"] = time.monotonic() - started
    print(f"wheel {wheel.name}: built in {timings['build_s']:.1f} s, installed with its "
          f"dependencies in {timings['install_s']:.1f} s")  # fmt: skip
    yield Installed(python, home, timings)


CHECK = """
import importlib.util, json, sys
import producer.client, shared
from shared.settings import config_paths, load_settings
s = load_settings()
print(json.dumps({
    "shared": shared.__file__,
    "config": [str(p) for p in config_paths()],
    "torch_installed": importlib.util.find_spec("torch") is not None,
    "torch_imported": "torch" in sys.modules,
    "modalities": sorted(s.modalities),
    "priorities": sorted(s.priorities),
}))
"""


def test_the_wheel_installs_a_client_without_torch_or_the_checkout(installed: Installed) -> None:
    out = json.loads(
        _run([installed.python, "-c", CHECK], installed.home, _clean_env(installed.home), 120)
    )
    site = installed.python.parent.parent
    assert Path(out["shared"]).is_relative_to(site), out  # the wheel's code, not this checkout
    assert out["config"] == [
        str(next(site.glob("lib/python*/site-packages/shared/settings/fleet.toml")))
    ]
    assert out["torch_installed"] is False and out["torch_imported"] is False
    assert out["modalities"] == ["image", "text", "video", "xmodal"]
    assert out["priorities"] == ["bulk", "high", "normal", "realtime"]


SUBMIT = """
import asyncio, json, sys
from producer.client import AsyncFleetClient, FleetClient, image_inputs

url, image = sys.argv[1], sys.argv[2]
client = FleetClient.from_url(url)
try:
    text = client.submit("text", {"text": "A man is playing a guitar."}).get(timeout_s=60)
    picture = client.submit("image", image_inputs(image)).get(timeout_s=60)
finally:
    client.close()

async def main():
    async with AsyncFleetClient.from_settings() as aio:  # FLEET_REDIS_URL
        h = await aio.submit("text", {"text": "A woman is reading."}, priority="high")
        return await h.result(timeout_s=60), await aio.live_workers("text")

result, live = asyncio.run(main())
print(json.dumps({"text": len(text["embedding"]), "image": picture["dim"],
                  "async_text": len(result["embedding"]), "live": live}))
"""


def test_the_installed_client_submits_text_and_image_with_only_the_url(
    installed: Installed, stack: Any
) -> None:
    url = stack.s.redis_url("producer")
    image = installed.home / IMAGE.name
    shutil.copyfile(IMAGE, image)
    env = _clean_env(installed.home, FLEET_REDIS_URL=url)
    started = time.monotonic()
    out = json.loads(_run([installed.python, "-c", SUBMIT, url, image], installed.home, env, 180))
    took = time.monotonic() - started
    assert out["text"] == 384 and out["async_text"] == 384
    assert out["image"] == 1280
    assert out["live"] and all(n.startswith("text@") for n in out["live"])
    print(f"submitted from {installed.home} in {took:.1f} s")

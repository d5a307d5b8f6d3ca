"""One request's path: the product modules a text request runs code in, measured on a real
worker, are exactly the ones README.md lists under "One request's path", and there are at most
20 of them (a newcomer follows a request through that many files, not more).

Measured, not read off the imports: the producer side with ``sys.setprofile`` around
``submit`` + ``get`` in this process; the worker side by a real text worker started with
``tests/integration/pathhook`` first on its ``PYTHONPATH`` (its ``sitecustomize`` records which
product modules run code, and when, on every thread). A worker module counts when it ran in the
window of at least 4 of 5 requests (from the submit to just after the result was read): work on
the worker's own schedule (lease renewal, the janitor, Redis' clock, heap trims) falls into a
window now and then, never into most of them.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import own_redis

REPO = Path(__file__).resolve().parents[2]
HOOK = Path(__file__).resolve().parent / "pathhook"
ROOTS = tuple(str(REPO / d) + os.sep for d in ("producer", "workers", "shared"))
REQUESTS = 5
AT_LEAST = 4
LIMIT = 20


def readme_path() -> list[str]:
    """The modules README's "One request's path" names, in its order (dotted names)."""
    text = (REPO / "README.md").read_text()
    section = text.split("\n## One request's path\n", 1)[1].split("\n## ", 1)[0]
    paths = re.findall(r"^\d+\. `([^`]+)`", section, re.M)
    return [p.rstrip("/").removesuffix(".py").replace("/", ".") for p in paths]


def test_readme_names_at_most_20_modules_that_exist() -> None:
    modules = readme_path()
    assert 0 < len(modules) <= LIMIT
    assert len(set(modules)) == len(modules)
    for m in modules:
        path = REPO / m.replace(".", "/")
        assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), m


@pytest.mark.timeout(300)
def test_a_text_request_runs_the_modules_readme_lists(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from producer.client import FleetClient

    record = tmp_path_factory.mktemp("path") / "record.json"
    pythonpath = os.pathsep.join(p for p in (str(HOOK), os.environ.get("PYTHONPATH", "")) if p)
    env = {
        "FLEET_PATH_RECORD": str(record),
        "FLEET_PATH_ROOTS": os.pathsep.join(ROOTS),
        "PYTHONPATH": pythonpath,
    }
    producer: Counter[str] = Counter()
    windows: list[tuple[float, float]] = []
    with own_redis(tmp_path_factory, "request-path") as st:
        st.start_worker("text", extra_env=env)
        client = FleetClient(st.s)
        try:
            client.submit("text", {"text": "warm up"}).get(timeout_s=120)
            time.sleep(2.0)  # what a first request starts (background warmup) settles
            for i in range(REQUESTS):
                seen: set[str] = set()

                def profile(frame: Any, event: str, arg: Any, seen: set[str] = seen) -> None:
                    if event == "call" and frame.f_code.co_filename.startswith(ROOTS):
                        seen.add(frame.f_globals.get("__name__", ""))

                start = time.time()
                sys.setprofile(profile)
                try:
                    # a deadline far off: the profiled worker on a slow host must not expire
                    # it (NORMAL's 2 s did once); the path is the same for any deadline
                    client.submit(
                        "text", {"text": f"A man is playing a guitar ({i})."}, timeout_s=30.0
                    ).get(timeout_s=30)
                finally:
                    sys.setprofile(None)
                windows.append((start, time.time() + 0.15))  # the acks follow the result
                producer.update(seen)
                time.sleep(0.5)
            time.sleep(1.2)  # the worker's record is written twice a second
            entries = json.loads(record.read_text())
        finally:
            client.close()
    worker: Counter[str] = Counter()
    for a, b in windows:
        worker.update({m for t, m in entries if a <= t <= b})
    measured = {m for m, n in producer.items() if n >= AT_LEAST} | {
        m for m, n in worker.items() if n >= AT_LEAST
    }
    listed = set(readme_path())
    assert measured == listed, (
        f"run but not listed: {sorted(measured - listed)}; "
        f"listed but not run: {sorted(listed - measured)}"
    )
    assert len(measured) <= LIMIT

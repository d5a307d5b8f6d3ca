"""Loaded at interpreter start by the text worker of ``tests/integration/test_request_path.py``
(its directory is put first on the worker's ``PYTHONPATH``): records, for every thread, which
product modules run code and when, with ``sys.setprofile``/``threading.setprofile``, and writes
the record to ``$FLEET_PATH_RECORD`` (JSON ``[[time, module], ...]``) twice a second.

One entry per module per 5 ms is kept, so a busy loop costs a set lookup per call, not a list
entry. Nothing else is changed in the worker.
"""

import json
import os
import sys
import threading
import time
from typing import Any

_OUT = os.environ.get("FLEET_PATH_RECORD")

if _OUT:
    _ROOTS = tuple(os.environ["FLEET_PATH_ROOTS"].split(os.pathsep))
    _seen: set[tuple[str, int]] = set()
    _record: list[tuple[float, str]] = []

    def _profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call" or not frame.f_code.co_filename.startswith(_ROOTS):
            return
        now = time.time()
        key = (frame.f_globals.get("__name__", ""), int(now * 200))
        if key not in _seen:
            _seen.add(key)
            _record.append((now, key[0]))

    def _dump() -> None:
        while True:
            time.sleep(0.5)
            tmp = _OUT + ".tmp"
            with open(tmp, "w") as f:
                json.dump(list(_record), f)
            os.replace(tmp, _OUT)

    sys.setprofile(_profile)
    threading.setprofile(_profile)
    threading.Thread(target=_dump, daemon=True, name="path-record").start()

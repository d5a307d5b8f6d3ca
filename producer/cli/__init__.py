"""The ``fleet`` command line: run workers, manage the local stack, submit requests and read
their results. Entry point ``fleet = "producer.cli:app"``; ``python -m producer.cli`` too.

Modules: ``base`` (the apps, exit codes, settings), ``diagnose`` (why the stack is not
usable), ``stack_cmds`` (worker, up, down, status, flower, redis-url, gateway, demo), ``submit``,
``results`` (result, watch), ``tools`` (bench, soak, chaos, shm), ``output``.

Exit codes: 0 ok, 1 the request failed or timed out, 2 refused input, 3 the stack or broker
is not usable (see ``producer.cli.base``).
"""

from __future__ import annotations

import importlib

from producer.cli.base import ExitCode, app

# The command modules register their commands; `fleet --help` lists them in this order.
for _module in ("stack_cmds", "submit", "results", "tools"):
    importlib.import_module(f"producer.cli.{_module}")

__all__ = ["ExitCode", "app"]

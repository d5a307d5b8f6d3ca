"""Producers and the stack launcher never import torch (and so never touch CUDA)."""

from __future__ import annotations

import os
import subprocess
import sys

# Importing workers.app builds its Celery app, which needs Redis credentials (not a server).
_ENV = {**os.environ, "FLEET_REDIS__PASSWORD": "import-only"}


def test_producer_side_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "import producer.client, producer.stack, producer.cli, producer.demo\n"
        "import shared.transport, shared.celery_app, shared.schema, workers.app\n"
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=_ENV
    )
    heavy = out.stdout.strip()
    # workers.app is the worker's own module: it may import torch, but no model library.
    assert "transformers" not in heavy


def test_client_and_stack_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import producer.client, producer.stack, producer.cli, shared.transport\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=_ENV
    )
    assert out.stdout.strip() == "False"

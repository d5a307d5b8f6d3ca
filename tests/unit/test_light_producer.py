"""Producers and the stack launcher never import torch (and so never touch CUDA)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from producer.client import FleetClient
from shared.errors import PayloadTooLarge
from shared.settings import load_settings

# Importing workers.consumer.app builds its Celery app, which needs Redis credentials (not a
# server).
_ENV = {**os.environ, "FLEET_REDIS__PASSWORD": "import-only"}


def test_producer_side_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "import producer.client, producer.stack.local, producer.cli, producer.tools.demo.run\n"
        "import shared.transport, shared.celery_app, shared.schema, workers.consumer.app\n"
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=_ENV
    )
    heavy = out.stdout.strip()
    # workers.consumer.app is the worker's own module: it may import torch, but no model library.
    assert "transformers" not in heavy


def test_client_and_stack_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import producer.client, producer.stack.local, producer.cli, shared.transport\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=_ENV
    )
    assert out.stdout.strip() == "False"


def test_an_over_long_text_is_refused_before_anything_is_sent() -> None:
    """``FleetClient.envelope`` applies the workers' text limit itself (no Redis needed: the
    refusal comes before any connection)."""
    settings = load_settings(redis={"password": "unused", "port": 1})
    client = FleetClient(settings)
    limit = settings.limits.max_text_chars
    assert client.envelope("text", {"text": "x" * limit}).inputs["text"] == "x" * limit
    for modality, inputs in (
        ("text", {"text": "x" * (limit + 1)}),
        ("xmodal", {"image_b64": "AAAA", "texts": ["ok", "y" * (limit + 1)]}),
    ):
        with pytest.raises(PayloadTooLarge, match="max_text_chars"):
            client.envelope(modality, inputs)
    # validation reads no clock from Redis either: not one TIME tried (a client that only
    # validates, like `fleet submit`'s option check, never connects)
    assert (client.clock.samples, client.clock.failures) == (0, 0)

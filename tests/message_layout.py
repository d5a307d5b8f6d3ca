"""``docs/message-layout.md`` read back, and the messages its tables are checked against.

The page has two tables: where a message waits (:func:`placements`) and the rules of its
bytes (:func:`rules`), each rule checked by ``tests/unit/test_message_layout.py`` (no
server) or, where it needs Redis, ``tests/integration/test_layout_scripts.py``.
:func:`build` makes the messages: ``producer.client.wire``'s, through
``FleetClient.outgoing``, for every modality and priority class.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from producer.client import FleetClient, image_inputs, video_inputs, xmodal_inputs
from producer.client.wire import fresh_ids
from shared import schema
from shared.schema import Priority
from shared.settings import MODALITIES

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "message-layout.md"
MAX_TEXT_CHARS = 20_000  # configs/fleet.toml [limits] max_text_chars


@dataclass(frozen=True)
class Placement:
    """A row of the page's first table: a priority class, its Celery priority, and its
    queue and list as templates over ``<modality>``."""

    cls: str
    celery_priority: int
    queue: str
    list: str

    def queue_for(self, modality: str) -> str:
        return self.queue.replace("<modality>", modality)

    def list_for(self, modality: str) -> str:
        raw = self.list.replace("<modality>", modality)
        return raw.encode().decode("unicode_escape")  # the page writes \x06\x16


@dataclass(frozen=True)
class Rule:
    """A row of the page's rules: its id, its text, the Lua it quotes (script file name ->
    expressions) and where it is checked (``unit`` or ``integration``)."""

    id: str
    text: str
    reads: dict[str, list[str]]
    checked: str

    def number(self, script: str, pattern: str) -> int:
        """The integer ``pattern``'s group finds in the one expression of ``script`` it
        matches (a tail length the page quotes)."""
        found = [m for e in self.reads[script] if (m := re.fullmatch(pattern, e))]
        assert len(found) == 1, f"rule {self.id}: {pattern!r} in {self.reads[script]}"
        return int(found[0].group(1))


def _tables(text: str) -> list[list[list[str]]]:
    """Every Markdown table of ``text``: its rows (the header's first), each a list of cells."""
    tables: list[list[list[str]]] = []
    current: list[list[str]] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                current.append(cells)
        elif current:
            tables.append(current)
            current = []
    return tables


def _code(cell: str) -> str:
    m = re.fullmatch(r"`([^`]*)`", cell)
    assert m, f"not a code span: {cell!r}"
    return m.group(1)


@cache
def placements() -> list[Placement]:
    """The page's first table."""
    head, *rows = _tables(PAGE.read_text(encoding="utf-8"))[0]
    assert head == ["Class", "Celery priority", "Queue", "List"], head
    return [Placement(c, int(p), _code(q), _code(li)) for c, p, q, li in rows]


def _reads(cell: str) -> dict[str, list[str]]:
    """A *Read by* cell's quotes: each code span after a ``<script>.lua`` one is an
    expression of that script."""
    out: dict[str, list[str]] = {}
    script = None
    for span in re.findall(r"`([^`]+)`", cell):
        if span.endswith(".lua"):
            script = span
            out.setdefault(script, [])
        elif script is not None:
            out[script].append(span)
    return out


@cache
def rules() -> dict[str, Rule]:
    """The page's rules, by id."""
    tables = _tables(PAGE.read_text(encoding="utf-8"))
    head, *rows = next(t for t in tables if t[0][0] == "Rule")
    assert head == ["Rule", "The bytes", "Read by", "Checked"], head
    out = {}
    for rid, text, reads, checked in rows:
        rule = Rule(_code(rid), text, _reads(reads), checked)
        assert rule.checked in ("unit", "integration"), rule
        out[rule.id] = rule
    return out


def lua_script(name: str) -> str:
    """The text of the product's Lua script file ``name``."""
    found = [p for root in ("shared", "workers", "producer") for p in (REPO / root).rglob(name)]
    assert len(found) == 1, f"{name}: {found}"
    return found[0].read_text(encoding="utf-8")


@dataclass
class Built:
    """One message as a producer pushes it, with what it was built from."""

    modality: str
    placement: Placement
    task_id: str
    env: Any  # its TaskEnvelope
    list_key: str
    payload: bytes
    traced: bool = False
    secret: str = ""  # a value of its inputs that must not show outside the body


def inputs_for(modality: str, size: int = 64) -> dict[str, Any]:
    """Inputs of ``modality`` with a file of about ``size`` bytes (a text: at most the shipped
    ``limits.max_text_chars``)."""
    data = bytes(range(256)) * (size // 256 + 1)
    if modality == "text":
        return {"text": "w" * min(size, MAX_TEXT_CHARS)}
    if modality == "image":
        return image_inputs(data[:size])
    if modality == "video":
        return video_inputs(data[:size])  # no store: inline
    return xmodal_inputs(data[:size], ["a cat", "a dog"])


def build(client: FleetClient, modality: str, cls: str, inputs: dict[str, Any], **kw: Any) -> Built:
    """The message ``client`` pushes for one request (``producer.client.wire``)."""
    env = client.envelope(modality, inputs, cls)
    (task_id,) = fresh_ids(1)
    (out,) = client.outgoing([env], [task_id])
    row = next(p for p in placements() if p.cls == cls)
    return Built(modality, row, task_id, env, out.key, out.payload, **kw)


def every_kind(client: FleetClient, size: int = 64) -> list[Built]:
    """One message per modality and priority class."""
    return [build(client, m, p.label, inputs_for(m, size)) for m in MODALITIES for p in Priority]


def queues() -> list[str]:
    """Every queue of the fleet."""
    return [q for m in MODALITIES for q in (schema.queue_name(m), schema.realtime_queue_name(m))]

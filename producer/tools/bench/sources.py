"""Request inputs from the repo's real data, as the messages carry them. Never imports torch.

Each source yields a list of ``inputs`` dicts in a fixed order (file order for texts, name
order for images); a workload walks that list from the start, wrapping around, so every mode
and every repetition sends the same inputs in the same order.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from producer.tools.bench.workload import SourceSpec

_IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff"}


class SourceError(ValueError):
    """A source cannot be read or is empty, or its kind cannot run yet."""


def load_inputs(spec: SourceSpec) -> list[dict[str, Any]]:
    """All inputs of a source, in order.

    Raises:
        SourceError: missing or empty data, or a ``tensor`` source (the transport runner's).
    """
    if spec.kind == "tensor":
        raise SourceError(
            "tensor sources are sent by the transport runner (producer/tools/bench/transport.py), "
            "not as requests"
        )
    path = spec.resolved_path()
    if not path.exists():
        raise SourceError(f"source path {path} does not exist")
    if spec.kind == "lines":
        out = [{"text": t} for t in _lines(path) if t.strip()]
    elif spec.kind == "jsonl":
        out = []
        for n, line in enumerate(_lines(path), 1):
            if not line.strip():
                continue
            try:
                out.append({"text": json.loads(line)[spec.field]})
            except (ValueError, KeyError) as exc:
                raise SourceError(
                    f"{path}:{n}: no {spec.field!r} in a JSON object: {exc}"
                ) from None
    else:
        out = [_image_inputs(p) for p in image_files(path, spec.pattern)]
    if not out:
        raise SourceError(f"source {path} yielded no inputs")
    return out


def _lines(path: Path) -> list[str]:
    """Lines split on ``\\n`` only: ``str.splitlines`` also splits on U+2028, form feeds and
    other separators that real texts (and JSON strings) contain."""
    return [line.removesuffix("\r") for line in path.read_text(encoding="utf-8").split("\n")]


def image_files(folder: Path, pattern: str = "*") -> list[Path]:
    """Image files directly under ``folder`` (not its subfolders), sorted by name."""
    return sorted(
        p for p in folder.glob(pattern) if p.is_file() and p.suffix.lower() in _IMAGE_SUFFIXES
    )


def _image_inputs(path: Path) -> dict[str, Any]:
    return {"image_b64": base64.b64encode(path.read_bytes()).decode("ascii")}


def input_length(inputs: dict[str, Any]) -> int:
    """A size for reports: characters of a text, bytes of an encoded image."""
    if "text" in inputs and isinstance(inputs["text"], str):
        return len(inputs["text"])
    b64 = inputs.get("image_b64")
    return len(b64) * 3 // 4 if isinstance(b64, str) else 0


class InputCatalog:
    """Every source's inputs, loaded once per bench run."""

    def __init__(self, sources: dict[str, SourceSpec], names: set[str] | None = None) -> None:
        self.specs = sources
        self._inputs = {
            name: load_inputs(spec)
            for name, spec in sources.items()
            if names is None or name in names
        }

    def size(self, source: str) -> int:
        return len(self._inputs[source])

    def get(self, source: str, index: int) -> dict[str, Any]:
        items = self._inputs[source]
        return items[index % len(items)]

    def modality(self, source: str) -> str:
        return self.specs[source].modality

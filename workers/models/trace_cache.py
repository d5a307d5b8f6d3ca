"""A cache of traced (TorchScript) encoders across worker starts: what cold start can skip.

A text worker's start was dominated by importing the model code (``transformers``' modeling
modules pull in ``torch.distributed``) and tracing the encoder, none of which depends on
anything but the weights, the code versions and the load options. So a traced encoder is
saved once (``torch.jit.save``) and the next start with the same key loads it
(``torch.jit.load``) without building the eager model at all.

Key: SHA-256 of the canonical JSON of everything the trace depends on (:func:`cache_key`):
the weights folder's files (name, size, mtime), torch and transformers versions, the
precision and its options, the device type, and a format number bumped when the adapter's
traced function changes.

Where: ``FLEET_TRACE_CACHE_DIR``, else ``$XDG_CACHE_HOME/mmfleet/traced``, else
``~/.cache/mmfleet/traced``; a directory of this uid, mode 0700 (created so; an existing one
that is not ours or is group/world-writable disables the cache with a warning). Entries are
``<key>.pt`` (the TorchScript archive, 0600) and ``<key>.json`` (the key's parts and the
archive's SHA-256): an entry whose archive does not hash to its record is ignored. A
TorchScript archive is code: only this uid's own cache directory is ever read.
``FLEET_TRACE_CACHE=0`` turns the cache off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

FORMAT = 1


def cache_dir() -> Path | None:
    """The cache directory (created 0700 if absent), or ``None`` when the cache is off or
    the directory is not safe to read code from."""
    if os.environ.get("FLEET_TRACE_CACHE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    env = os.environ.get("FLEET_TRACE_CACHE_DIR")
    if env:
        root = Path(env)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = Path(base) / "mmfleet" / "traced"
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = root.lstat()
    except OSError as exc:
        log.warning("trace cache off: %s: %s", root, exc)
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        log.warning("trace cache off: %s is not a directory of this uid closed to others", root)
        return None
    return root


def folder_fingerprint(path: str | Path) -> list[list[Any]]:
    """``[[name, size, mtime_ns], ...]`` of the regular files directly in ``path``, sorted."""
    out = []
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        if entry.is_file(follow_symlinks=True):
            st = entry.stat()
            out.append([entry.name, st.st_size, st.st_mtime_ns])
    return out


def cache_key(parts: Mapping[str, Any]) -> str:
    """SHA-256 hex of ``parts`` (JSON-able) as canonical JSON, with :data:`FORMAT` added."""
    blob = json.dumps({"format": FORMAT, **parts}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load(key: str, device: torch.device) -> torch.jit.ScriptModule | None:
    """The cached module for ``key`` on ``device``, or ``None`` (absent, unsafe, damaged)."""
    root = cache_dir()
    if root is None:
        return None
    archive, record = root / f"{key}.pt", root / f"{key}.json"
    try:
        st = archive.lstat()
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            return None
        meta = json.loads(record.read_text())
        if meta.get("sha256") != _sha256(archive):
            log.warning("trace cache entry %s does not match its record: ignored", key[:12])
            return None
        return torch.jit.load(str(archive), map_location=device)
    except FileNotFoundError:
        return None
    except Exception as exc:  # a damaged entry costs a trace, never a start
        log.warning("trace cache entry %s unreadable (%s): ignored", key[:12], exc)
        return None


def save(key: str, module: torch.jit.ScriptModule, parts: Mapping[str, Any]) -> bool:
    """Store ``module`` under ``key`` (atomically: temp file, then rename). ``False`` if the
    cache is off or the write failed (logged; the worker runs on)."""
    root = cache_dir()
    if root is None:
        return False
    tmp = record = ""
    try:
        fd, tmp = tempfile.mkstemp(dir=root, prefix=".tmp-", suffix=".pt")
        os.close(fd)
        fd, record = tempfile.mkstemp(dir=root, prefix=".tmp-", suffix=".json")
        os.close(fd)
        torch.jit.save(module, tmp)
        os.chmod(tmp, 0o600)
        meta = {"sha256": _sha256(Path(tmp)), "parts": dict(parts), "format": FORMAT}
        Path(record).write_text(json.dumps(meta))
        os.replace(tmp, root / f"{key}.pt")
        os.replace(record, root / f"{key}.json")
        return True
    except Exception as exc:
        log.warning("trace cache: could not store %s: %s", key[:12], exc)
        return False
    finally:
        for leftover in (tmp, record):
            if leftover:
                Path(leftover).unlink(missing_ok=True)

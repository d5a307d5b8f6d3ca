"""Where the fleet's settings files, run directory and secret files are.

:func:`config_paths` lists the TOML files in use (``$FLEET_CONFIG`` or the nearest
``configs/fleet.toml``); :func:`locate_run_dir` finds the run directory (the rules are in
``shared.settings``' docstring); :func:`ensure_secret` creates a secret file (mode 0600) on
first use. Import these names from ``shared.settings``.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from pathlib import Path

__all__ = [
    "PACKAGED_CONFIG",
    "REPO_CONFIG",
    "config_paths",
    "ensure_secret",
    "locate_run_dir",
    "project_root",
    "user_run_dir",
]

# The defaults beside this package's source tree (a checkout).
REPO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "fleet.toml"


# The same file packaged in the wheel (in a checkout, a link to REPO_CONFIG): what an
# installed package reads when no configs/fleet.toml is found.
PACKAGED_CONFIG = Path(__file__).resolve().parent / "fleet.toml"


def project_root(cwd: Path, package_root: Path) -> Path | None:
    """The project checkout to run from: the nearest directory at or above ``cwd`` holding
    ``configs/fleet.toml`` and ``pyproject.toml``, else ``package_root`` (the source tree
    this package was loaded from) when it is such a checkout and writable; else ``None``."""

    def is_root(d: Path) -> bool:
        return (d / "configs" / "fleet.toml").is_file() and (d / "pyproject.toml").is_file()

    for d in (cwd, *cwd.parents):
        if is_root(d):
            return d
    if is_root(package_root) and os.access(package_root, os.W_OK):
        return package_root
    return None


def user_run_dir(env: Mapping[str, str]) -> Path:
    """The per-user run directory: ``$XDG_STATE_HOME/mmfleet/run``, default
    ``~/.local/state/mmfleet/run``."""
    state = env.get("XDG_STATE_HOME") or str(
        Path(env.get("HOME", "~")).expanduser() / ".local" / "state"
    )
    return Path(state) / "mmfleet" / "run"


def locate_run_dir(
    configured: Path, *, explicit: bool, cwd: Path, package_root: Path, user_dir: Path
) -> tuple[Path, str]:
    """Where the stack's run directory is, and why (for messages). No I/O but ``stat``.

    Args:
        configured: ``[stack] run_dir`` as configured (absolute or relative).
        explicit: it was set with ``FLEET_STACK__RUN_DIR``: a relative path is relative to
            ``cwd``, as any path on a command line.
        cwd: the current directory; package_root: this package's source tree.
        user_dir: the per-user fallback (:func:`user_run_dir`).

    Returns:
        ``(absolute path, source)``; the source names the setting, the project root or the
        per-user location.
    """
    if explicit:
        return (cwd / configured).resolve(), "set by FLEET_STACK__RUN_DIR"
    if configured.is_absolute():
        return configured, "set by [stack] run_dir in the config"
    root = project_root(cwd, package_root)
    if root is not None:
        return (root / configured).resolve(), f"in the project root {root}"
    return user_dir, "the per-user location (no project checkout found)"


def config_paths() -> list[Path]:
    """The TOML files in use, merged in order (later files override keys of earlier ones).

    ``$FLEET_CONFIG`` is one path or several joined by ``:`` (e.g. the defaults plus an
    overlay: ``configs/fleet.toml:configs/overlays/gpu.toml``); without it,
    ``configs/fleet.toml`` of the current directory or the nearest one above it, else the
    one beside this package's source tree (a checkout), else the copy packaged with it (an
    installed wheel: :data:`PACKAGED_CONFIG`).

    Raises:
        FileNotFoundError: a file named in ``$FLEET_CONFIG`` does not exist.
    """
    env = os.environ.get("FLEET_CONFIG")
    if env:
        paths = [Path(p) for p in env.split(os.pathsep) if p]
        for p in paths:
            if not p.is_file():
                raise FileNotFoundError(f"FLEET_CONFIG names {p}, which does not exist")
        return paths
    cwd = Path.cwd()
    for d in (cwd, *cwd.parents):
        if (d / "configs" / "fleet.toml").is_file():
            return [d / "configs" / "fleet.toml"] if d != cwd else [Path("configs/fleet.toml")]
    return [REPO_CONFIG] if REPO_CONFIG.is_file() else [PACKAGED_CONFIG]


def ensure_secret(path: Path) -> str:
    """Read a secret file, creating it (mode 0600, 32 url-safe chars) if it does not exist."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(24))
    return path.read_text().strip()

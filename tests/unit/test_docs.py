"""The documentation: README.md as a manual, the pages under docs/ as a MkDocs site.

- README.md stays a manual: at most :data:`README_MAX_LINES` lines; the long sections are
  pages under ``docs/``, and the README links to every one of them.
- README.md and the pages say what is true now: no run dates, times of day, commit hashes or
  development sessions (:func:`history_marks`). ``docs/measurements/`` is exempt: it is
  generated, one page per day of runs, and dates are what it is about.
- Every relative link in README.md points at a file that exists (on GitHub the README links
  to the pages as ``docs/<page>.md``).
- ``mkdocs build --strict`` succeeds: every page in the nav exists, every link between pages
  and every anchor resolves, no page is left out of the nav (``mkdocs.yml``).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
README_MAX_LINES = 450

# A run date: ISO (2026-12-03), or a month's name and a day (Dec 3, December 3).
_DATE = re.compile(
    r"\b\d{4}-\d{2}-\d{2}\b"
    r"|\b(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec)[a-z]*\.? \d{1,2}\b"
)
# A time of day: with its zone (19:54 UTC), or a window (19:54-20:00).
_TIME = re.compile(r"\b\d{1,2}:\d{2}(?::\d{2})?\s*(?:UTC|GMT)\b|\b\d{1,2}:\d{2}-\d{1,2}:\d{2}\b")
# A development session by number (session 13).
_SESSION = re.compile(r"\bsession \d+\b", re.I)
# A commit hash: 7 to 40 lowercase hex digits standing alone (no letter, digit, "_" or "-"
# touching either end, so the parts of a uuid, a 64-digit SHA-256 or a word's tail are not
# one), with at least one digit and one letter a-f: plain numbers (9100) and plain words
# made of a-f (added, decade, facade) are not hashes.
_HEX = re.compile(r"(?<![\w-])[0-9a-f]{7,40}(?![\w-])")


def _is_hash(token: str) -> bool:
    return any(c.isdigit() for c in token) and any(c.isalpha() for c in token)


def history_marks(text: str) -> list[str]:
    """The run dates, times of day, sessions and commit hashes in ``text``."""
    found = [m[0] for rx in (_DATE, _TIME, _SESSION) for m in rx.finditer(text)]
    return found + [t for t in _HEX.findall(text) if _is_hash(t)]


def pages() -> list[Path]:
    """The documentation pages: ``docs/**/*.md`` but the generated ``docs/measurements/``."""
    return sorted(p for p in DOCS.rglob("*.md") if "measurements" not in p.relative_to(DOCS).parts)


def relative_links(markdown: str) -> list[str]:
    """The targets of the inline links of ``markdown`` that are paths (not URLs, not
    anchors of the same page), without their anchors."""
    targets = re.findall(r"\]\(([^)\s]+)\)", markdown)
    return [
        t.split("#", 1)[0]
        for t in targets
        if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")
    ]


def test_history_marks_are_told_from_figures_and_words() -> None:
    text = (
        "at commit a05caac, session 13, 2026-12-03 19:54-20:00 UTC, on Dec 3; "
        "port 9100, 12.6 s, a decade, 550e8400-e29b-41d4-a716-446655440000, "
        "sha256 " + "ab12" * 16 + ", the fleet_submitted_ms header, t" + "0f" * 16
    )
    assert history_marks(text) == [
        "2026-12-03", "Dec 3", "19:54-20:00", "session 13", "a05caac",
    ]  # fmt: skip


def test_readme_is_a_manual_of_bounded_length() -> None:
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; move long sections to docs/"


@pytest.mark.parametrize(
    "path", [README, *pages()], ids=lambda p: str(p.relative_to(REPO))
)  # fmt: skip
def test_no_run_dates_commits_or_sessions(path: Path) -> None:
    marks = history_marks(path.read_text())
    assert not marks, f"{path.relative_to(REPO)} names run dates or history: {marks}"


def test_readme_links_point_at_files_that_exist() -> None:
    links = relative_links(README.read_text())
    assert links, "the README links to its pages"
    missing = sorted({t for t in links if not (REPO / t).exists()})
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_readme_links_every_page() -> None:
    linked = {(REPO / t).resolve() for t in relative_links(README.read_text())}
    top = list(DOCS.glob("*.md"))
    unlinked = sorted(str(p.relative_to(REPO)) for p in top if p.resolve() not in linked)
    assert not unlinked, f"README.md does not link to {unlinked}"


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None,
    reason="mkdocs is not installed (pip install -e '.[dev]')",
)
def test_mkdocs_builds_the_site_strictly(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
         "--site-dir", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "index.html").exists()  # README.md, the home page

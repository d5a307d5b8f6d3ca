"""MkDocs hook: the repository's README.md is the site's home page.

The README lives at the repository root and links to the pages as GitHub shows them
(``docs/gateway.md``); the pages link back to it as ``../README.md``. On the site the README
is one more page of ``docs_dir`` (MkDocs serves a ``README.md`` as the index), so both kinds of
link are rewritten to links between pages of one folder before MkDocs validates them. Nothing
is copied: the README is read where it is.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

README = "README.md"
# a Markdown link target that starts with docs/ (the README's links to the pages)
_TO_DOCS = re.compile(r"\]\(docs/")


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add the repository's README.md as the site's index page."""
    root = Path(config.config_file_path).resolve().parent
    files.append(File.generated(config, README, abs_src_path=str(root / README)))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """The README's ``docs/X`` links become ``X``; a page's ``../README.md`` (one ``../`` more
    than its depth below ``docs/``) becomes the README page's path from it."""
    src = page.file.src_uri
    if src == README:
        return _TO_DOCS.sub("](", markdown)
    depth = src.count("/")
    return markdown.replace(f"]({'../' * (depth + 1)}{README}", f"]({'../' * depth}{README}")

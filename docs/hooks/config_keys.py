"""MkDocs hook: the configuration page's table of every key, generated from the one source.

A page that holds the line ``<!-- config-keys -->`` gets, in its place, one table row per config key (dotted
key, default, meaning) from :func:`stabletrain.config.schema.describe_keys`, the same rows that
``stabletrain train --help`` prints. So the docs cannot list a key the code does not have, or miss one.
"""

from __future__ import annotations

import sys
from pathlib import Path

MARKER = "<!-- config-keys -->"


def _rows() -> list[tuple[str, str, str]]:
    src = Path(__file__).resolve().parents[2] / "src"  # this checkout's package, installed or not
    if str(src) not in sys.path:
        sys.path.insert(0, str(src))
    from stabletrain.config.schema import describe_keys

    return describe_keys()


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ANN001 (MkDocs' hook signature)
    if MARKER not in markdown:
        return markdown
    lines = ["| key | default | meaning |", "| --- | --- | --- |"]
    lines += [f"| `{key}` | `{_cell(default)}` | {_cell(meaning)} |" for key, default, meaning in _rows()]
    return markdown.replace(MARKER, "\n".join(lines))

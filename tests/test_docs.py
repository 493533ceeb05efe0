"""The README stays short and points at pages that exist; the docs site builds with ``mkdocs build --strict``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """The anchor Python-Markdown's toc gives a heading (its default slugify), or the explicit ``{#id}``."""
    explicit = re.search(r"\{#([\w-]+)\}\s*$", heading)
    if explicit:
        return explicit.group(1)
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(page: Path) -> set[str]:
    text, headings = page.read_text(encoding="utf-8"), set()
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            headings.add(_slug(line.lstrip("#").strip()))
    return headings


def test_the_readme_is_short_and_keeps_the_two_commands():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; the rest belongs in docs/"
    for marker, words in (("<!-- main-command -->", "stabletrain train"), ("<!-- test-command -->", "pytest")):
        at = lines.index(marker)
        assert lines[at + 1] == "```bash" and words in lines[at + 2] and lines[at + 3] == "```", marker


def test_the_readmes_python_snippets_run_as_written(tmp_path, monkeypatch):
    """A trial: the README's one Python block (the Lightning callback) called `lightning.Trainer` without importing
    lightning: a NameError as written. Each block runs (what it leaves to the reader is a comment)."""
    pytest.importorskip("lightning")
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
    monkeypatch.chdir(tmp_path)
    assert blocks
    for i, block in enumerate(blocks, 1):
        exec(compile(block, f"README.md python block {i}", "exec"), {"__name__": "__readme__"})


def test_every_link_from_the_readme_into_the_docs_resolves():
    links = [target for target in _LINK.findall(README.read_text(encoding="utf-8")) if target.startswith("docs/")]
    assert len(links) >= 20  # the README sends its reader to the docs for the rest
    for target in links:
        path, _, anchor = target.partition("#")
        page = ROOT / path
        assert page.is_file(), f"README.md links to {target}: no such file"
        if anchor:
            assert anchor in _anchors(page), f"README.md links to {target}: {path} has no heading with that anchor"


def test_every_docs_page_is_in_the_nav():
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert len(pages) >= 20
    assert [p for p in pages if p not in config] == []


@pytest.mark.slow  # starts a process: the site build
def test_the_docs_build_strictly_and_offline(tmp_path):
    from stabletrain.config.schema import describe_keys

    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # The configuration page's table is generated from the config's one source: one row per key.
    config_page = (site / "configuration" / "index.html").read_text(encoding="utf-8")
    table = config_page.split('id="every-key"', 1)[1]
    assert table.count("<tr>") == len(describe_keys()) + 1  # the header and every key
    assert "<code>guard.on_nonfinite</code>" in table
    # The API reference is rendered from the docstrings, their Sphinx roles read as code.
    api = (site / "api" / "loop" / "index.html").read_text(encoding="utf-8")
    assert 'id="stabletrain.step.TrainStep"' in api and ":meth:" not in api and "::</p>" not in api
    # Nothing is fetched when a page is read either: no web font, the picture is local.
    home = (site / "index.html").read_text(encoding="utf-8")
    assert "fonts.googleapis" not in home and (site / "report.png").stat().st_size > 50_000

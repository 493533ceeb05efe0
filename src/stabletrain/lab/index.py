"""``labs/index.html``: one self-contained page with every lab that ran (PNGs embedded as data URIs).

Per lab: the chapter's question (and its original text), the setup, the numbers, the observations
checked with PASS/FAIL, the plots, and the explanation written from the measured numbers. Built from
the run report's page pieces (:mod:`stabletrain.report.html`), so it looks like the report.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

from .._version import __version__
from ..fileio import atomic_write
from ..report.html import esc, figure, page, table
from ..report.plots import Plot
from . import LabResult, fmt

__all__ = ["write_index", "render_index"]

_CSS = """
<style>
section.lab { margin-top:34px; }
section.lab h2 { display:flex; gap:10px; align-items:center; }
.question { font-size:15px; margin:4px 0 2px; }
.zh { color:var(--muted); margin:0 0 8px; }
.setup { color:var(--muted); font-size:12.5px; margin:0 0 10px; }
ul.claims { list-style:none; padding:0; margin:10px 0; }
ul.claims li { padding:3px 0 3px 56px; position:relative; }
ul.claims li .badge { position:absolute; left:0; top:5px; }
.explain p { margin:6px 0; max-width:980px; }
h3 { font-size:14px; margin:16px 0 6px; color:#3b444d; }
/* One plot per row, never drawn wider than its pixels: a two-panel plot at half the page had 4-6 px legends. */
.lab-plots { grid-template-columns:1fr; }
.lab-plots figure img { width:auto; max-width:100%; margin:0 auto; }
</style>
"""


# The chapter's original lines are Chinese. Where the browser has no font for them (a headless Linux without
# fonts-noto-cjk) they would show as boxes: this hides them, leaving the English line. Missing glyphs all
# draw the same box (.notdef), two different characters of a real font never do. (Firefox draws a box
# with the code point instead, so there the lines stay, as boxes; docs/labs.md names the font package.)
_CJK_FALLBACK = """
<script>
(function () {
  var lines = Array.prototype.slice.call(document.querySelectorAll('.zh'));
  var chars = lines.map(function (p) { return p.textContent; }).join('').match(/[\u4e00-\u9fff]/g) || [];
  chars = chars.filter(function (c, i) { return chars.indexOf(c) === i; });
  if (chars.length < 2) return;
  var canvas = document.createElement('canvas');
  canvas.width = canvas.height = 40;
  var ctx = canvas.getContext('2d');
  ctx.font = '32px ' + getComputedStyle(lines[0]).fontFamily;
  function ink(c) { ctx.clearRect(0, 0, 40, 40); ctx.fillText(c, 2, 32); return ctx.getImageData(0, 0, 40, 40).data.join(); }
  var shown = ink(chars[0]) !== ink(chars[1]);
  lines.forEach(function (p) { p.hidden = !shown; });
  document.documentElement.setAttribute('data-zh', shown ? 'shown' : 'hidden');
})();
</script>
"""


def _cells(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    numeric = [all(isinstance(r[i], (int, float)) and not isinstance(r[i], bool) or r[i] is None for r in rows)
               for i in range(len(columns))]
    return table([esc(c) for c in columns], [[esc(fmt(v)) for v in row] for row in rows],
                 classes=["num" if n else "" for n in numeric])


def _section(result: LabResult) -> str:
    info = result.info
    badge = '<span class="badge ok">PASS</span>' if result.passed else '<span class="badge bad">FAIL</span>'
    parts = [f'<section class="lab" id="lab-{esc(info.key)}">',
             f"<h2>{badge} lab {esc(info.key)}: {esc(info.title)}</h2>",
             f'<p class="question"><b>Question.</b> {esc(info.question)}</p>',
             f'<p class="zh" lang="zh">{"<b>The chapter.</b> " if info.quoted else ""}{esc(info.question_zh)}</p>',
             f'<p class="setup"><b>Setup.</b> {esc(result.setup)} ({result.seconds:.1f} s)</p>',
             "<h3>Numbers</h3>", _cells(result.columns, result.rows)]
    for title, columns, rows in result.tables:
        parts += [f"<h3>{esc(title)}</h3>", _cells(columns, rows)]
    parts.append("<h3>Observations</h3>")
    parts.append('<ul class="claims">' + "".join(
        f'<li><span class="badge {"ok" if c.passed else "bad"}">{"PASS" if c.passed else "FAIL"}</span>'
        f"{esc(c.text)}: measured <code>{esc(c.measured)}</code> (threshold <code>{esc(c.threshold)}</code>)</li>"
        for c in result.claims) + "</ul>")
    if result.plots:
        parts.append('<div class="plots lab-plots">' + "".join(
            figure(Plot(p.stem, p.name, p.read_bytes())) for p in result.plots) + "</div>")
    parts.append('<h3>Why</h3><div class="explain">' + "".join(f"<p>{esc(s)}</p>" for s in result.explanation) + "</div>")
    parts.append("</section>")
    return "\n".join(parts)


def render_index(results: Sequence[LabResult]) -> str:
    """Return the index page for ``results`` as one HTML document."""
    passed = sum(r.passed for r in results)
    nav = " ".join(f'<a href="#lab-{esc(r.key)}">lab {esc(r.key)} {"✓" if r.passed else "✗"}</a>' for r in results)
    head = (f"<h1>stabletrain labs</h1><p class=\"sub\">The chapter's exercises, run and checked: {passed} of "
            f"{len(results)} labs passed; {sum(r.seconds for r in results):.0f} s in all. "
            f"stabletrain {esc(__version__)}, {esc(time.strftime('%Y-%m-%d %H:%M'))}.</p><nav>{nav}</nav>")
    body = _CSS + head + "\n".join(_section(r) for r in results) + _CJK_FALLBACK
    return page("stabletrain labs", body)


def write_index(results: Sequence[LabResult], out_dir: str | Path) -> Path:
    """Write ``out_dir/index.html`` for ``results`` (atomically); return its path."""
    path = Path(out_dir) / "index.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, render_index(results), fsync=False)

"""Open the report and compare pages in real headless Chromium: they render, images load, no console errors.

Chromium is driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``: JSON messages
ending in NUL on fds 3 and 4), so the test needs only the standard library. Skipped only where
Debian's ``chromium`` is not installed (``.ci/run`` installs it).
"""

from __future__ import annotations

import base64
import fcntl
import io
import json
import math
import os
import select
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from PIL import Image, ImageStat

from stabletrain import Trainer, load_config
from stabletrain.report import write_compare, write_report

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed "
                                "(apt-get install chromium; .ci/run installs it)")]

IMAGES_LOADED = "Array.from(document.images).map(i => ({src: i.src.slice(0, 40), ok: i.complete && i.naturalWidth > 0}))"


class DevToolsPipe:
    """A headless Chromium and a minimal DevTools-protocol client over its pipe."""

    def __init__(self, exe: str, profile: Path) -> None:
        child_in, self._out = os.pipe()  # we write commands; chromium reads them on fd 3
        self._in, child_out = os.pipe()  # chromium writes replies and events on fd 4

        def place_fds() -> None:  # in the child: move the pipe ends to fds 3 and 4 (dup2 makes them inheritable)
            r, w = fcntl.fcntl(child_in, fcntl.F_DUPFD, 10), fcntl.fcntl(child_out, fcntl.F_DUPFD, 10)
            os.dup2(r, 3)
            os.dup2(w, 4)

        self.stderr = open(profile.parent / "chromium.log", "wb")
        self.proc = subprocess.Popen(
            [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--remote-debugging-pipe", f"--user-data-dir={profile}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.stderr, preexec_fn=place_fds,
            close_fds=False)  # our own pipe ends are close-on-exec, so only fds 3 and 4 reach chromium
        os.close(child_in)
        os.close(child_out)
        self._buf, self._id, self.pending = b"", 0, []

    def call(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 30) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}, **({"sessionId": session} if session else {})}
        os.write(self._out, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._next(timeout)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
            self.pending.append(reply)

    def wait_for(self, method: str, timeout: float = 30) -> dict:
        for i, event in enumerate(self.pending):
            if event.get("method") == method:
                return self.pending.pop(i)
        while True:
            event = self._next(timeout)
            if event.get("method") == method:
                return event
            self.pending.append(event)

    def _next(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._in], [], [], left)[0]:
                raise TimeoutError(f"chromium sent nothing for {timeout:.0f} s")
            chunk = os.read(self._in, 1 << 20)
            if not chunk:
                raise RuntimeError(f"chromium exited (code {self.proc.poll()}); see {self.stderr.name}")
            self._buf += chunk
        message, self._buf = self._buf.split(b"\0", 1)
        return json.loads(message)

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=10)
            self.proc.wait(timeout=10)
        except (OSError, RuntimeError, TimeoutError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            os.close(self._in)
            os.close(self._out)
            self.stderr.close()


@dataclass
class Rendered:
    images: list[dict]
    errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    screenshot: Image.Image | None = None
    text: str = ""


def render(browser: DevToolsPipe, page: Path, width: int = 1280) -> Rendered:
    """Load ``page`` in a fresh tab; return its images' state, console errors, requests and a full-page screenshot."""
    target = browser.call("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = browser.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    for domain in ("Runtime", "Log", "Network", "Page"):
        browser.call(f"{domain}.enable", session=session)
    browser.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": 900, "deviceScaleFactor": 1, "mobile": False},
                 session=session)
    browser.pending.clear()
    browser.call("Page.navigate", {"url": page.resolve().as_uri()}, session=session)
    browser.wait_for("Page.loadEventFired")

    def evaluate(expression: str):
        reply = browser.call("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session=session)
        return reply["result"]["value"]

    out = Rendered(images=evaluate(IMAGES_LOADED), text=evaluate("document.body.innerText"))
    size = browser.call("Page.getLayoutMetrics", session=session)["cssContentSize"]
    shot = browser.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": {
        "x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}}, session=session)
    out.screenshot = Image.open(io.BytesIO(base64.b64decode(shot["data"])))
    for event in browser.pending:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            out.errors.append("console: " + " ".join(str(a.get("value", a.get("description"))) for a in params.get("args", [])))
        elif method == "Runtime.exceptionThrown":
            out.errors.append("exception: " + params["exceptionDetails"].get("text", ""))
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            out.errors.append("log: " + params["entry"].get("text", ""))
        elif method == "Network.loadingFailed":
            out.errors.append("failed to load: " + params.get("errorText", ""))
        elif method == "Network.requestWillBeSent":
            out.requests.append(params["request"]["url"].split(":", 1)[0])
    browser.call("Target.closeTarget", {"targetId": target})
    return out


def assert_not_blank(image: Image.Image) -> None:
    gray = image.convert("L")
    assert ImageStat.Stat(gray).stddev[0] > 10, "the screenshot is (nearly) one flat colour"
    histogram = gray.histogram()
    background = max(histogram) / sum(histogram)
    assert background < 0.9, f"{background:.0%} of the screenshot is the background colour"


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    profile = tmp_path_factory.mktemp("chromium") / "profile"
    b = DevToolsPipe(CHROMIUM, profile)
    yield b
    b.close()


def train(path: Path, overrides: list[str], bad_steps: tuple[int, ...] = ()) -> Path:
    """Train the built-in mlp task for 40 steps into ``path``; the loss is inf on ``bad_steps`` (skips, events)."""
    base = ["task=mlp", "train.max_steps=40", "log.every=5", "eval.every=20", "log.progress=false", "log.tensorboard=false",
            "log.init_signal=false"]  # (the loss below counts its calls: the step-0 report's forward would be one more)
    trainer = Trainer(load_config(None, [*base, *overrides]), run_dir=path)
    mean_loss, calls = trainer.task.loss, [0]

    def loss(model, batch):
        calls[0] += model.training  # one training call per optimizer step; eval calls don't count
        return mean_loss(model, batch) * (math.inf if model.training and calls[0] in bad_steps else 1.0)

    trainer.task.loss = loss
    trainer.fit()
    return path


@pytest.fixture(scope="module")
def pages(tmp_path_factory) -> dict[str, Path]:
    """A real short run with two skipped steps, its report, and its comparison with a second run."""
    root = tmp_path_factory.mktemp("pages")
    runs = [train(root / "a", ["clip.max_norm=0.8"], bad_steps=(12, 13)), train(root / "b", ["optim.lr=3e-3"])]
    return {"report": write_report(runs[0]), "compare": write_compare(runs, root / "compare.html")}


@pytest.mark.parametrize("which, min_images, must_read", [
    ("report", 7, ["Health", "Clipping fired on", "2 steps skipped at 12-13", "Events", "Config", "Snapshot"]),
    ("compare", 9, ["Config keys that differ (2)", "optim.lr", "by samples seen"]),  # (fp32 runs: no loss-scale panel)
])
def test_page_renders_in_headless_chromium(browser, pages, which, min_images, must_read):
    shown = render(browser, pages[which])
    shown.screenshot.save(pages["report"].parent.parent / f"{which}.screenshot.png")  # to look at by eye
    num_images = pages[which].read_text(encoding="utf-8").count("<img ")
    assert num_images >= min_images
    assert len(shown.images) == num_images and all(i["ok"] for i in shown.images), shown.images
    assert shown.errors == []
    assert set(shown.requests) <= {"file", "data"}, f"the page fetched {shown.requests}: it must be self-contained"
    for text in must_read:
        assert text in shown.text
    assert shown.screenshot.height > 1500  # the whole page, not just the first screen
    assert_not_blank(shown.screenshot)


def test_the_checks_catch_a_broken_page(browser, tmp_path):
    """The harness is not vacuous: a broken image and a console error are seen."""
    page = tmp_path / "broken.html"
    page.write_text('<!DOCTYPE html><html><body><p>broken</p><img src="data:image/png;base64,AAAA">'
                    '<script>console.error("planted error")</script></body></html>')
    shown = render(browser, page)
    assert [i["ok"] for i in shown.images] == [False]
    assert any("planted error" in e for e in shown.errors)
    with pytest.raises(AssertionError):  # a nearly empty page
        assert_not_blank(shown.screenshot)


def test_labs_page_shows_the_chinese_line_only_where_the_browser_has_a_font_for_it(browser, tmp_path):
    """Without a CJK font (``fc-list :lang=zh`` empty) the chapter's Chinese line would be boxes: it is hidden,
    the English question stays; with one it is shown."""
    from stabletrain.lab import LABS, run_lab
    from stabletrain.lab.index import write_index

    page = write_index([run_lab("3", tmp_path)], tmp_path)
    fonts = subprocess.run(["fc-list", ":lang=zh"], capture_output=True, text=True).stdout.strip() if shutil.which(
        "fc-list") else ""
    shown = render(browser, page)
    assert shown.errors == []
    assert LABS["3"].question in shown.text
    assert (LABS["3"].question_zh in shown.text) == bool(fonts), (fonts, shown.text[:400])


IMAGE_SCALES = ("Array.from(document.images).map(i => ({alt: i.alt, shown: i.getBoundingClientRect().width, "
                "natural: i.naturalWidth}))")


def evaluated(browser: DevToolsPipe, page: Path, expression: str, width: int = 1280):
    """The value of JavaScript ``expression`` on ``page``, loaded in a fresh tab of a ``width`` px wide window."""
    target = browser.call("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = browser.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    browser.call("Page.enable", session=session)
    browser.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": 900, "deviceScaleFactor": 1, "mobile": False},
                 session=session)
    browser.pending.clear()
    browser.call("Page.navigate", {"url": page.resolve().as_uri()}, session=session)
    browser.wait_for("Page.loadEventFired")
    reply = browser.call("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session=session)
    browser.call("Target.closeTarget", {"targetId": target})
    return reply["result"]["value"]


def shown_scales(browser: DevToolsPipe, page: Path, width: int = 1280) -> list[dict]:
    """Each image's drawn width over its pixel width, on ``page`` in a ``width`` px wide window."""
    return evaluated(browser, page, IMAGE_SCALES, width)


def test_lab_plot_legends_are_readable_at_1280_px(browser, tmp_path, monkeypatch):
    """A legend's size on screen = its points x dpi / 72 x (drawn width / pixel width); at least 10 px (it was ~4-6 px:
    7 pt legends on two-panel plots drawn at half the page)."""
    from matplotlib.figure import Figure

    from stabletrain.lab import run_lab
    from stabletrain.lab.index import write_index

    saved, original = [], Figure.savefig

    def savefig(fig, *args, **kwargs):  # every lab figure as it is written: its legends' font sizes and its dpi
        sizes = [t.get_fontsize() for leg in [*fig.legends, *(ax.get_legend() for ax in fig.axes)] if leg is not None
                 for t in leg.get_texts()]
        saved.append((min(sizes, default=None), kwargs.get("dpi", fig.dpi), fig.get_figwidth()))
        return original(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    results = [run_lab("3", tmp_path), run_lab("4", tmp_path)]
    page = write_index(results, tmp_path)
    scales = [i["shown"] / i["natural"] for i in shown_scales(browser, page) if i["natural"]]
    assert len(scales) == len(saved) >= 2 and all(pt is not None for pt, _, _ in saved)  # each plot has a legend
    smallest = min(pt * dpi / 72 * scale for (pt, dpi, _), scale in zip(saved, scales))
    assert smallest >= 10, (saved, scales)
    assert all(scale <= 1.0 for scale in scales)  # never drawn wider than its pixels (a blurred upscale)


def test_remedy_table_and_compare_panels_read_as_the_cli_does(browser, tmp_path):
    """The report's Remedies table: "-" where a candidate has no end loss (as `stabletrain remedy` prints), candidate
    names on one line; the comparison's post-clip panel starts at 0 (it was zoomed to 0.96-1.00)."""
    import json as _json

    run = train(tmp_path / "run", ["clip.max_norm=0.8"])
    incident = run / "incidents" / "step_000012"
    incident.mkdir(parents=True)
    (incident / "remedy.json").write_text(_json.dumps({
        "step": 12, "failure_class": "divergence", "evidence": "loss grew", "steps": 4, "best": "rollback-lr-x0.1",
        "timings": {"steps_replayed": 20, "total_s": 1.5},
        "candidates": [{"name": "rollback-lr-x0.1", "verdict": "cures", "end_loss": 7.717e-08,
                        "detail": "back to step 0, lr x0.1", "evidence": (
                            "steps 1-42 finite, no spike; end loss 7.717e-08 vs 2.696 at step 5, the last healthy "
                            "interval (the baseline fails: non-finite loss at step 39 (loss inf, grad norm inf))")},
                       {"name": "skip-step", "baseline": True, "verdict": "fails", "end_loss": float("nan"),
                        "detail": "drop the incident's window", "evidence": "non-finite loss at step 39 (loss inf, "
                                                                            "grad norm inf)"}]}))
    page = write_report(run)
    text = page.read_text(encoding="utf-8")
    assert ">7.717e-08<" in text and ">-<" in text and ">nan<" not in text
    lines = evaluated(browser, page, (  # lines of text in each candidate's name cell
        "Array.from(document.querySelectorAll('#remedies ~ table tbody tr td:nth-child(2) code')).map(c => "
        "c.getClientRects().length)"))
    assert lines == [1, 1]  # "rollback-lr-x0.1" wrapped at its hyphens beside a long evidence cell: [3, 1]


def test_the_compare_summary_fits_the_page_and_the_resolved_precision_is_named_so(browser, tmp_path):
    """A new user's comparison (lr, bf16, accumulation): the Summary table ran past the right edge at 1300 px (every cell
    a number's, kept on one line, the goodput sentence too), the second run's column cut off; and 'precision' was listed
    twice (auto | bf16 among the config keys, fp32 | bf16 in the snapshot) with nothing saying fp32 was auto's."""
    runs = [train(tmp_path / "a", []), train(tmp_path / "b", ["optim.lr=3e-3", "precision=bf16", "accum.steps=2"])]
    page = write_compare(runs, tmp_path / "compare.html")
    text = page.read_text(encoding="utf-8")
    assert ">precision (resolved)<" in text and text.count(">precision<") == 1  # the config key's row, and the snapshot's
    widths = evaluated(browser, page, (
        "[document.querySelector('#summary ~ table').getBoundingClientRect().right, document.documentElement.clientWidth]"))
    assert widths[0] <= widths[1], widths

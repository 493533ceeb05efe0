"""The run report and the comparison page, rendered from real short runs and checked against their files."""

from __future__ import annotations

import html
import json
import math
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from stabletrain import Trainer, load_config
from stabletrain.records.jsonl import read_jsonl
from stabletrain.report import config_diff, health_summary, load_run, write_compare, write_report
from stabletrain.report.compare import render_compare, run_labels
from stabletrain.report.plots import COMPARE_METRICS, RUN_PLOT_NAMES, run_plots
from stabletrain.report.text import fmt_num, fmt_pct, fmt_ranges, step_ranges
from stabletrain.tasks import resolve_task

pytestmark = pytest.mark.slow  # real training runs as fixtures

# Training steps (1-based) whose loss is made infinite: the loop then records real nonfinite and skip events.
BAD_STEPS = (12, 13)
BASE = ["task=mlp", "train.max_steps=40", "log.every=5", "eval.every=20", "log.progress=false", "log.tensorboard=false",
        "log.init_signal=false"]  # (make_run's loss counts its calls: the step-0 report's forward would be one more)


def make_run(path: Path, overrides: list[str] = (), bad_steps: tuple[int, ...] = (), factor: float = math.inf) -> Path:
    """Train the built-in mlp task for 40 steps into ``path``; the loss is inf (x ``factor``) on ``bad_steps``."""
    cfg = load_config(None, [*BASE, *overrides])
    task = resolve_task("mlp")
    mean_loss, calls = task.loss, [0]

    def loss(model, batch):
        out = mean_loss(model, batch)
        if model.training:  # one call per optimizer step (accum.steps=1); eval calls don't count
            calls[0] += 1
            if calls[0] in bad_steps:
                out = out * factor
        return out

    task.loss = loss
    Trainer(cfg, task=task, run_dir=path).fit()
    return path


def append_events(run_dir: Path, *events: dict) -> None:
    with open(run_dir / "events.jsonl", "a", encoding="utf-8") as fh:
        for e in events:
            fh.write(json.dumps({"time": 1.7e9, **e}) + "\n")


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> Path:
    """A real 40-step run: clipping fires on some steps (threshold 0.8), steps 12-13 are non-finite and skipped."""
    return make_run(tmp_path_factory.mktemp("report") / "run", ["clip.max_norm=0.8"], BAD_STEPS)


@pytest.fixture(scope="module")
def other_run(tmp_path_factory) -> Path:
    """A second real run with a different LR and batch size (so tokens seen differ per step)."""
    return make_run(tmp_path_factory.mktemp("report") / "run_b", ["optim.lr=3e-3", "train.batch_size=32"])


@pytest.fixture
def run_copy(real_run, tmp_path) -> Path:
    """A private copy of the real run that a test may add lines to."""
    dst = tmp_path / "run"
    shutil.copytree(real_run, dst, ignore=shutil.ignore_patterns("report.html", "plots"))
    return dst


def expected_figures(run_dir: Path) -> dict:
    """The health figures, worked out straight from metrics.jsonl (no report code involved)."""
    records, problems = read_jsonl(run_dir / "metrics.jsonl")
    assert not problems
    prev, clipped, steps = 0, 0.0, 0
    for r in records:  # clip_rate is over each interval's applied steps
        applied = r["step"] - prev - r["num_skipped"]
        clipped += r["clip_rate"] * applied
        steps += applied
        prev = r["step"]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    return {
        "clip_rate": clipped / steps, "clipped_steps": round(clipped), "steps": steps,
        "skipped": sum(r["num_skipped"] for r in records), "nonfinite": sum(r["num_nonfinite"] for r in records),
        "val": val, "best": min(val, key=lambda sv: sv[1]),
        "loss_first": records[0]["loss"], "loss_last": records[-1]["loss"],
    }


# -- the run report -------------------------------------------------------------------------------


def test_report_of_a_real_run_has_every_plot_and_true_health_figures(real_run):
    out = write_report(real_run)
    assert out == real_run / "report.html"
    page = out.read_text(encoding="utf-8")

    # Every plot is embedded in the page and written as a PNG file ("other_metrics" where the loop logs keys
    # this report does not know, e.g. guard counters).
    others = load_run(real_run).other_metric_keys()
    # fp32 with two skipped steps: the skipped steps alone, no loss-scale panel (a flat line at 1 says nothing).
    expected_plots = [n for n in RUN_PLOT_NAMES if (n != "other_metrics" or others) and n != "loss_scale"]
    for name in expected_plots:
        assert f'id="plot-{name}"' in page
        with Image.open(real_run / "plots" / f"{name}.png") as im:
            assert im.format == "PNG" and im.width > 300 and im.height > 150
    assert page.count('src="data:image/png;base64,') == len(expected_plots)
    # Self-contained: nothing is fetched, nothing needs JS.
    assert not re.search(r'(src|href)="(https?:)?//', page) and "<script" not in page and "@import" not in page

    # The health summary states what metrics.jsonl says.
    want = expected_figures(real_run)
    assert want["skipped"] == 2 and want["nonfinite"] == 2 and 0 < want["clip_rate"] < 1  # the run did what we planned
    assert (f"Clipping fired on {fmt_pct(want['clip_rate'])} of steps ({want['clipped_steps']} of {want['steps']}; "
            "threshold 0.8)") in page
    assert "2 steps skipped at 12-13 (non-finite loss or grad norm)." in page
    assert ("2 steps had a non-finite loss or grad norm (first at step 12); an incident captures the first of its log "
            "interval (1 below).") in page
    (s0, v0), (s1, v1) = want["val"][0], want["val"][-1]
    trend = "fell" if v1 < v0 else "did not fall"
    assert (f"validation loss {trend}: {fmt_num(v0)} at step {s0} → {fmt_num(v1)} at step {s1}, "
            f"best {fmt_num(want['best'][1])} at step {want['best'][0]}") in page
    assert "Reached step 40 of 40." in page

    # Incidents and checkpoints, as events.jsonl records them.
    events, problems = read_jsonl(real_run / "events.jsonl")
    assert not problems
    incidents = [e for e in events if e["kind"] == "incident"]
    if incidents:
        summary = incidents[0].get("diagnosis", {}).get("summary") or incidents[0]["reason"]
        assert f"{len(incidents)} incident{'s' if len(incidents) > 1 else ''}: at step {incidents[0]['step']}, " in page
        assert html.escape(summary.rstrip(".")) in page
    else:
        assert "No incidents." in page
    checkpoints = [e for e in events if e["kind"] == "checkpoint"]
    if checkpoints:
        n = len(checkpoints)
        assert f"{n} checkpoint{'s' if n > 1 else ''}, the last at step {checkpoints[-1]['step']}." in page
    for kind in {e["kind"] for e in events}:
        assert f'<span class="kind {kind}">{kind}</span>' in page

    figures = health_summary(load_run(real_run)).figures
    assert figures["clip_rate"] == pytest.approx(want["clip_rate"], abs=1e-12)
    assert figures["skipped_steps"] == 2 and figures["skip_steps"] == list(BAD_STEPS)
    assert figures["val_best"] == want["best"][1] and figures["loss_last"] == want["loss_last"]

    # The real events of the run are in the timeline (a burst of skips is one row), config and snapshot as tables.
    assert re.search(r"12–13</td><td[^>]*><span class=\"kind skip\">skip</span> ×2", page)
    assert '<span class="kind nonfinite">nonfinite</span> ×2' in page
    assert "<td class=\"key\">clip.max_norm</td><td class=\"val\">0.8</td>" in page
    assert "<td class=\"key\">versions.torch</td>" in page and "Data problems" not in page


def test_report_lists_every_kind_of_event(run_copy):
    (run_copy / "events.jsonl").write_text("")  # only the events below (the loop's own are checked above)
    append_events(
        run_copy,
        {"step": 0, "kind": "init_overwritten", "reason": "init changed after the fingerprint",
         "params": [{"name": "0.weight", "old_std": 0.102, "new_std": 0.5}]},
        {"step": 20, "kind": "checkpoint", "reason": "periodic", "path": "checkpoints/step_000020"},
        {"step": 25, "kind": "spike", "reason": "loss 9.1 > 3.2 x running mean", "loss": 9.1},
        {"step": 26, "kind": "incident", "reason": "non-finite grad norm", "path": "incidents/step_000026",
         "diagnosis": {"summary": "first non-finite value in 2.weight grad after op aten::mm", "module": "2"}},
        {"step": 26, "kind": "diagnosis", "reason": "replay finished", "first_op": "aten::mm"},
        {"step": 30, "kind": "checkpoint_withheld", "reason": "inside an incident"},
        {"step": 35, "kind": "lab_note", "reason": "something a later version logs", "value": 3},
        {"step": 40, "kind": "stop", "reason": "max_steps reached"},
    )
    page = write_report(run_copy).read_text(encoding="utf-8")
    h = health_summary(load_run(run_copy))
    assert h.level == "bad" and h.figures["incidents"] == [(26, "first non-finite value in 2.weight grad after op aten::mm")]
    assert "1 incident: at step 26, first non-finite value in 2.weight grad after op aten::mm." in page
    assert "1 loss spike at step 25." in page
    assert "1 checkpoint, the last at step 20; 1 withheld (inside an incident)." in page
    assert "Initialization was overwritten at step 0 for 1 parameter (0.weight)." in page
    assert "Stopped at step 40: max_steps reached." in page
    for kind in ("init_overwritten", "checkpoint", "spike", "incident", "diagnosis", "checkpoint_withheld", "lab_note", "stop"):
        assert f'<span class="kind {kind}">{kind}</span>' in page
    assert "<code>checkpoints/step_000020</code>" in page and "<code>incidents/step_000026</code>" in page
    assert "<code>0.weight</code> std 0.102 → 0.5" in page
    assert "first_op: <code>aten::mm</code>" in page and "value: <code>3</code>" in page  # unknown fields listed plainly


def test_report_of_a_resumed_run_keeps_the_latest_record_per_step(run_copy):
    records, _ = read_jsonl(run_copy / "metrics.jsonl")
    # The first process logged to step 40 and skipped 12-13; the run is resumed from the checkpoint at step 10,
    # so steps 11-40 are trained (and logged) again, this time without a skip.
    append_events(run_copy, {"step": 10, "kind": "resume", "reason": "resumed from checkpoints/step_000010"})
    with open(run_copy / "metrics.jsonl", "a", encoding="utf-8") as fh:
        for r in records[2:]:
            fh.write(json.dumps({**r, "loss": 1.0 + r["step"] / 1000, "loss_max": 2.0, "num_skipped": 0, "num_nonfinite": 0,
                                 "clip_rate": 1.0}) + "\n")
    run = load_run(run_copy)
    assert [r["step"] for r in run.metrics] == list(range(5, 41, 5))
    assert run.metrics[-1]["loss"] == pytest.approx(1.04)
    h = health_summary(run)
    assert h.figures["skipped_steps"] == 0 and h.figures["skip_steps"] == []  # the old skips were replayed away
    assert h.figures["clip_rate"] == pytest.approx((5 * records[0]["clip_rate"] + 5 * records[1]["clip_rate"] + 30) / 40)
    page = write_report(run_copy).read_text(encoding="utf-8")
    assert "Resumed once, at step 10." in page and "No steps skipped." in page
    replayed = [e for e in run.events if e.step > 10]  # written by the first process, then trained again
    assert {"skip", "nonfinite"} <= {e.kind for e in replayed} and all(e.superseded for e in replayed)
    assert {e.superseded_by for e in replayed} == {"resume"} and not run.undone_events("skip", "nonfinite", "incident")
    assert page.count("superseded: this stretch was trained again after a resume (the same steps; the later line counts)") >= 2


def test_report_of_a_run_in_progress(real_run, tmp_path):
    run_dir = tmp_path / "live"
    run_dir.mkdir()
    shutil.copy(real_run / "config.yaml", run_dir)
    lines = (real_run / "metrics.jsonl").read_text().splitlines()
    (run_dir / "metrics.jsonl").write_text(lines[0] + "\n" + lines[1] + "\n" + lines[2][:40])  # the writer is mid-line
    page = write_report(run_dir).read_text(encoding="utf-8")
    assert "Logged up to step 10 of 40 (still running, or stopped early)." in page
    assert f"{run_dir / 'metrics.jsonl'}:3: malformed JSON" in page and "the run may still be writing it" in page
    assert f"{run_dir / 'snapshot.json'}: missing" in page
    # With the launch's record: its process alive (this one), or gone with no stop or crash recorded (killed outright)
    from stabletrain.records.launches import LAUNCH_FILE, this_process

    (run_dir / LAUNCH_FILE).write_text(json.dumps({"processes": [this_process()]}))
    assert "Logged up to step 10 of 40 (still running)." in write_report(run_dir).read_text(encoding="utf-8")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (run_dir / LAUNCH_FILE).write_text(json.dumps({"processes": [{**this_process(), "pid": gone.pid, "start": None}]}))
    assert ("Logged up to step 10 of 40 (its processes are gone with no stop or crash recorded: killed? stabletrain train "
            f"--resume {run_dir} continues it).") in write_report(run_dir).read_text(encoding="utf-8")  # (a trial: no RUN_DIR)
    assert "No events: events.jsonl is empty or missing" in page

    just_started = tmp_path / "just_started"
    just_started.mkdir()
    shutil.copy(real_run / "config.yaml", just_started)
    page = write_report(just_started).read_text(encoding="utf-8")
    assert "No metrics logged yet" in page and "data:image/png" not in page


def test_malformed_lines_are_reported_with_file_and_line_never_raised(run_copy, capsys):
    with open(run_copy / "metrics.jsonl", "a", encoding="utf-8") as fh:
        fh.write("{not json\n[1, 2]\n")
        fh.write(json.dumps({"step": "late", "loss": 1.0}) + "\n")
        fh.write(json.dumps({"step": 45, "loss": "oops", "grad_norm": 0.5}) + "\n")
    append_events(run_copy, {"kind": "skip", "reason": "no step"})
    (run_copy / "events.jsonl").open("a").write("\x00garbage\n")
    (run_copy / "config.yaml").write_text("clip:\n  max_norm: [1,\n")
    (run_copy / "snapshot.json").write_text('{"seed": 0,\n  "oops"\n}')
    n_metrics = len((run_copy / "metrics.jsonl").read_text().splitlines()) - 4
    n_events = len((run_copy / "events.jsonl").read_text().splitlines())

    page = write_report(run_copy).read_text(encoding="utf-8")
    m, e = run_copy / "metrics.jsonl", run_copy / "events.jsonl"
    for where in (f"{m}:{n_metrics + 1}: malformed JSON", f"{m}:{n_metrics + 2}: expected a JSON object, got list",
                  f"{m}:{n_metrics + 3}: &#x27;step&#x27; is missing", f"{m}:{n_metrics + 4}: &#x27;loss&#x27; is not a number",
                  f"{e}:{n_events - 1}: &#x27;step&#x27; is missing", f"{e}:{n_events}: malformed JSON",
                  f"{run_copy / 'config.yaml'}:3: malformed YAML", f"{run_copy / 'snapshot.json'}:3: malformed JSON"):
        assert where in page, where
    assert "Data problems (8)" in page and "8 problems reading the run&#x27;s files" in page
    run = load_run(run_copy)
    assert run.metrics[-1]["step"] == 45 and "loss" not in run.metrics[-1]  # the good values of the line are kept
    assert all(f'id="plot-{n}"' in page for n in RUN_PLOT_NAMES if n not in ("other_metrics", "loss_scale"))
    assert "Clipping is off" not in page and "The clip threshold is unknown" in page  # the config was not read: no verdict
    from stabletrain.cli import main  # the console's summary says so too (it was on the page only)

    capsys.readouterr()
    assert main(["report", str(run_copy)]) == 0
    said = capsys.readouterr().err
    assert said.startswith("stabletrain: warning: the run's files have 8 unreadable parts, left out of the summary: "
                           f"{run_copy / 'config.yaml'}:3: malformed YAML") and "and 7 more (the page lists them" in said


def test_unknown_numeric_metric_keys_get_their_own_plot(run_copy):
    records, _ = read_jsonl(run_copy / "metrics.jsonl")
    lines = [json.dumps({**r, "num_widgets": i % 2, "loss_ema": r["loss"], "note": "text"}) for i, r in enumerate(records)]
    (run_copy / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    others = load_run(run_copy).other_metric_keys()
    assert {"num_widgets", "loss_ema"} <= set(others) and "note" not in others and "loss" not in others
    page = write_report(run_copy).read_text(encoding="utf-8")
    assert 'id="plot-other_metrics"' in page and (run_copy / "plots" / "other_metrics.png").is_file()


def test_not_a_run_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        write_report(tmp_path / "nope")
    with pytest.raises(ValueError, match="not a run directory"):
        write_report(tmp_path)


# -- compare --------------------------------------------------------------------------------------


def test_compare_two_real_runs(real_run, other_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = write_compare([real_run, other_run], tmp_path)  # a directory: DIR/compare.html
    assert out == tmp_path / "compare.html"
    page = out.read_text(encoding="utf-8")

    # The config keys that differ, and only those.
    diff = dict(config_diff([load_run(real_run).config, load_run(other_run).config]))
    assert diff == {"train.batch_size": [16, 32], "clip.max_norm": [0.8, 1.0], "optim.lr": [0.001, 0.003]}
    assert "Config keys that differ (3)" in page and "reads only the run directories." in page
    for key in diff:
        assert f'<td class="key">{key}</td>' in page
    assert '<td class="key">optim.lr</td><td class="val">0.001</td><td class="val">0.003</td>' in page
    assert '<td class="key">seed</td>' not in page
    assert '<td class="key">config_hash</td>' not in page  # (a trial: it differs by run.dir alone, read as another config)

    # Every metric overlaid, by step and by tokens seen, embedded and as PNG files; no loss-scale panel, as one run's
    # report has none: neither run scales its loss (a new user's trial: a flat 1.00 drawn twice)
    drawn = [key for key in COMPARE_METRICS if key != "loss_scale"]
    for key in drawn:
        assert f'id="plot-{key}"' in page
        with Image.open(tmp_path / "compare_plots" / f"{key}.png") as im:
            assert im.width > 2 * im.height  # two panels side by side
    assert page.count('src="data:image/png;base64,') == len(drawn) and 'id="plot-loss_scale"' not in page
    assert "by samples seen" in page and "<script" not in page  # mlp's loss counts samples
    # The summary row states each run's skipped steps.
    assert re.search(r"<td class=\"\">skipped steps</td><td class=\"num\">2</td><td class=\"num\">0</td>", page)
    assert "<td class=\"\">non-finite steps (fp16 overflows aside)</td>" in page  # (beside overflow incidents: "0")
    assert page.count(">finished</td>") == 2  # how each ended ("—" for a run that finished: read as unknown)

    custom = write_compare([real_run, other_run], out=tmp_path / "sub" / "ab.html")
    assert custom.is_file() and (tmp_path / "sub" / "ab_plots" / "loss.png").is_file()
    with pytest.raises(ValueError, match="at least two"):
        write_compare([real_run])
    with pytest.raises(ValueError, match=f"run directory '{re.escape(str(real_run))}' is given twice: compare needs"):
        write_compare([real_run, other_run, real_run])
    again = str(real_run) + "/"  # the same folder spelled another way
    with pytest.raises(ValueError, match=r"is given twice \(as "):
        write_compare([real_run, again])


def test_stabletrain_compare_prints_the_keys_that_differ_and_each_runs_headline(real_run, other_run, tmp_path, capsys):
    """A trial: `stabletrain compare` printed only where its page went; the console now has the page's gist."""
    from stabletrain.cli import main

    assert main(["compare", str(real_run), str(other_run), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    a, b = run_labels([load_run(real_run), load_run(other_run)])
    assert out[0] == (f"config: 3 keys differ ({a} | {b}): train.batch_size 16 | 32; clip.max_norm 0.8 | 1; "
                      "optim.lr 0.001 | 0.003"), out
    figures = [health_summary(load_run(d)).figures for d in (real_run, other_run)]
    for line, label, f in zip(out[1:3], (a, b), figures):
        assert line.startswith(f"{label}: loss {fmt_num(f['loss_start'])} -> {fmt_num(f['loss_end'])}"), line
        assert line.endswith(f"0 loss spikes, {f['nonfinite_steps']} non-finite step{'s' if f['nonfinite_steps'] != 1 else ''}"
                             f", {f['skipped_steps']} skipped step{'s' if f['skipped_steps'] != 1 else ''}, "
                             f"{len(f['incidents'])} incident{'s' if len(f['incidents']) != 1 else ''} captured; finished"), line
    assert out[3] == f"stabletrain: comparison written to {tmp_path / 'compare.html'} (plots in {tmp_path / 'compare_plots'})"


def test_compare_draws_post_clip_norms_from_zero_and_one_setting_of_two_hosts_once(real_run, other_run, tmp_path,
                                                                                  monkeypatch):
    figs = _figures_of(monkeypatch)
    write_compare([real_run, other_run], tmp_path / "c.html")
    names = [p for p in COMPARE_METRICS if any(load_run(r).series(p)[0] for r in (real_run, other_run))]
    post = figs[names.index("grad_norm_post_clip")]
    for ax in post.axes:  # clipped norms sit at the threshold (0.8, 1.0): the panel starts at 0, not at ~0.76
        assert ax.get_ylim()[0] == 0 and ax.get_ylim()[1] >= 1.0
        dashed = [line.get_ydata() for line in ax.get_lines() if line.get_linestyle() == "--"]
        assert sorted(y[0] for y in dashed if len(y)) == [0.8, 1.0]  # each run's threshold (and a legend entry)

    # A Monitor run and a Lightning run with the same clip: host.clip_max_norm vs host.gradient_clip_val is one
    # setting under two hosts' names, not two differences; clip.max_norm is what compares them. (The config table: one
    # plot drawn.)
    from stabletrain.report import compare, plots

    only_loss = {"loss": plots.COMPARE_METRICS["loss"]}
    monkeypatch.setattr(plots, "COMPARE_METRICS", only_loss)
    monkeypatch.setattr(compare, "COMPARE_METRICS", only_loss)
    runs = []
    for name, host in (("loop", {"log_every": 10, "clip_max_norm": 1.0}), ("lightning", {"gradient_clip_val": 1.0,
                                                                                        "accumulate_grad_batches": 1})):
        run = tmp_path / name
        shutil.copytree(real_run, run, ignore=shutil.ignore_patterns("report.html", "plots", "checkpoints"))
        config = {"integration": name if name != "loop" else "monitor", "task": "Net", "clip": {"max_norm": 1.0},
                  "log": {"every": 10}, "host": host}
        (run / "config.yaml").write_text(json.dumps(config))
        runs.append(run)
    page = write_compare(runs, tmp_path / "hosts.html").read_text(encoding="utf-8")
    assert "host.clip_max_norm" not in page and "host.gradient_clip_val" not in page
    for run, lr in zip(runs, (1e-3, 3e-3)):  # two CLI runs: run.dir differs as always, shown, not counted (a trial)
        config = json.loads((run / "config.yaml").read_text())
        (run / "config.yaml").write_text(json.dumps({**config, "run": {"dir": str(run)}, "optim": {"lr": lr}}))
    dirs = write_compare(runs, tmp_path / "dirs.html").read_text(encoding="utf-8")
    assert "Config keys that differ (2, and run.dir)" in dirs and '<td class="key">run.dir</td>' in dirs
    assert "Config keys that differ (1)" in page  # the host itself; each host's own argument names: left out, said
    assert '<td class="key">integration</td>' in page and '<td class="key">clip.max_norm</td>' not in page
    assert "4 <code>host.*</code> keys are left out: each host (lightning, monitor) names its own arguments" in page


def test_compare_labels_runs_with_the_same_folder_name(real_run, tmp_path):
    twin = tmp_path / "elsewhere" / real_run.name
    shutil.copytree(real_run, twin)
    runs = [load_run(real_run), load_run(twin)]
    labels = run_labels(runs)
    assert labels == [f"{real_run.parent.name}/{real_run.name}", f"elsewhere/{real_run.name}"]
    page = render_compare(runs, labels, plots=[])
    assert f"<b>elsewhere/{real_run.name}</b>" in page and "The configs are identical." in page


def test_config_diff_marks_missing_keys():
    diff = config_diff([{"a": {"b": 1, "c": 2}}, {"a": {"b": 1}, "d": None}])
    assert [k for k, _ in diff] == ["a.c", "d"]


# -- text helpers ---------------------------------------------------------------------------------


def test_text_helpers():
    assert step_ranges([13, 12, 20, 12, 21, 30]) == [(12, 13), (20, 21), (30, 30)]
    assert fmt_ranges([812, 813, 1500]) == "812-813, 1,500"
    assert fmt_ranges(range(0, 40, 2), limit=2) == "0, 2, and 18 more"
    assert (fmt_pct(0.37), fmt_pct(0.004), fmt_pct(0.996), fmt_pct(0.0), fmt_pct(1.0)) == ("37%", "0.4%", "99.6%", "0%", "100%")
    assert [fmt_num(x) for x in (10366.1, 2.2971, math.nan, None, 40.0)] == ["10,366", "2.297", "nan", "—", "40"]
    assert [fmt_num(x) for x in (226312448.0, 3.2e9, 1e30, 9999999.0, 12345678)] == [
        "2.263e+08", "3.2e+09", "1e+30", "9,999,999", "12,345,678"]  # a huge loss short; a count whole


# -- a crash, a stop, and the task's unit ---------------------------------------------------------


def test_report_of_a_run_that_crashed_at_step_1_says_so_first(tmp_path, capsys):
    from stabletrain.cli import main

    run_dir = tmp_path / "crashed"
    cfg = load_config(None, ["task=user_code_tasks:unpack_loss_task", *BASE[1:]])
    with pytest.raises(ValueError, match="not enough values to unpack"):
        Trainer(cfg, run_dir=run_dir).fit()
    tasks_file = Path(__file__).parent / "user_code_tasks.py"
    line = next(i for i, text in enumerate(tasks_file.read_text().splitlines(), 1) if "x, y, w = batch" in text)
    crash = (f"The run crashed at step 1 (during a training step): ValueError: not enough values to unpack "
             f"(expected 3, got 2) (at {tasks_file}:{line} in loss).")
    health = health_summary(load_run(run_dir))
    assert health.sentences[0] == ("bad", crash) and health.level == "bad"
    assert health.figures["crash"]["step"] == 1 and health.figures["crash"]["error"] == "ValueError"
    assert "No metrics logged yet" not in health.text and "No metrics were logged before the crash." in health.text

    page = write_report(run_dir).read_text(encoding="utf-8")
    assert '<span class="badge bad">problems</span>' in page and "worth a look" not in page
    assert f'<li class="bad">{html.escape(crash)}</li>' in page
    assert "No metrics: the run crashed at step 1" in page and '<span class="kind crash">crash</span>' in page
    assert "task <b>user_code_tasks:unpack_loss_task (regression)</b>" in page  # the spec and Task.name
    summary = render_compare([load_run(run_dir)] * 2, ["a", "b"], plots=[])
    assert summary.count("crash at step 1 (ValueError)") == 2

    assert main(["report", str(run_dir)]) == 0  # the printed summary starts with the crash
    printed = capsys.readouterr().out.splitlines()
    assert printed[1].startswith(crash)


def test_a_crash_resumed_from_is_history_and_a_signal_stop_is_said_plainly(run_copy):
    append_events(run_copy, {"step": 20, "kind": "crash", "reason": "RuntimeError: boom", "error": "RuntimeError",
                             "message": "boom\nsecond line", "location": "train.py:3 in loss",
                             "during": "a training step (window or gradient all-reduce)"},
                  {"step": 20, "kind": "resume", "reason": "resumed from step_000020 at step 20"},
                  {"step": 40, "kind": "stop", "reason": "stopping: stopped by SIGTERM at step 40"})
    health = health_summary(load_run(run_copy))
    assert "crash" not in health.figures and not health.text.startswith("The run crashed")
    assert "Crashed and resumed 1 time: at step 21, RuntimeError: boom (at train.py:3 in loss)." in health.text
    assert "Stopped at step 40 by SIGTERM." in health.text
    # Resumed after the stop: the run went on, so it no longer ends with one.
    append_events(run_copy, {"step": 40, "kind": "resume", "reason": "resumed from step_000040 at step 40"})
    assert "Stopped at step" not in health_summary(load_run(run_copy)).text


def _captured_axes(monkeypatch):
    """Draw without encoding: keep each figure's axes (title, x label, y label) instead of its PNG."""
    from stabletrain.report import plots

    drawn = []

    def keep(fig):
        drawn.append([(ax.get_title(loc="left"), ax.get_xlabel(), ax.get_ylabel()) for ax in fig.axes])
        return b""

    monkeypatch.setattr(plots, "_png", keep)
    return drawn


def test_throughput_and_items_seen_are_in_the_tasks_unit(real_run, other_run, tmp_path, monkeypatch):
    from stabletrain.report.plots import compare_plots, run_plots, shared_unit

    samples = load_run(real_run)  # mlp: its (sum, count) counts samples
    assert samples.count_unit == "samples" and samples.snapshot["count_unit"] == "samples"
    tokens_dir = tmp_path / "tokens_run"
    shutil.copytree(other_run, tokens_dir, ignore=shutil.ignore_patterns("report.html", "plots"))
    snap = json.loads((tokens_dir / "snapshot.json").read_text())
    (tokens_dir / "snapshot.json").write_text(json.dumps({**snap, "count_unit": "tokens"}))
    tokens = load_run(tokens_dir)

    assert re.search(r"Median [\d,]+ samples/s;", health_summary(samples).text) and "tokens/s" not in health_summary(samples).text
    assert re.search(r"Median [\d,]+ tokens/s;", health_summary(tokens).text)
    drawn = _captured_axes(monkeypatch)
    names = [p.name for p in run_plots(samples)]
    assert drawn[names.index("tokens_per_s")][0] == ("Throughput", "step", "samples/s")

    drawn.clear()
    plots = compare_plots([samples, load_run(other_run)], ["a", "b"])
    by_key = dict(zip([p.name for p in plots], drawn))
    assert by_key["loss"][1] == ("Train loss by samples seen", "samples seen", "loss")
    assert by_key["tokens_per_s"][0][2] == "samples/s"
    drawn.clear()
    compare_plots([samples, tokens], ["a", "b"])  # different units: both by the samples each saw, which both log
    assert drawn[0][1][:2] == ("Train loss by samples seen", "samples seen")
    assert shared_unit([tokens, tokens]) == "tokens"

    page = render_compare([samples, tokens], ["a", "b"], plots=[])
    assert "Right: by samples seen. The runs&#x27; losses count different items (samples for a, tokens for b)" in page
    assert re.search(r"median throughput</td><td class=\"num\">[\d,]+ samples/s</td><td class=\"num\">[\d,]+ tokens/s", page)


def test_compare_writes_nothing_in_the_current_directory(real_run, other_run, tmp_path, monkeypatch, capsys):
    from stabletrain.cli import main
    from stabletrain.report import compare, plots

    only_loss = {"loss": plots.COMPARE_METRICS["loss"]}  # where the files go, not what they draw: one plot (2 s -> 0.3 s)
    monkeypatch.setattr(plots, "COMPARE_METRICS", only_loss)
    monkeypatch.setattr(compare, "COMPARE_METRICS", only_loss)

    a, b = tmp_path / "runs" / "a", tmp_path / "runs" / "b"
    for src, dst in ((real_run, a), (other_run, b)):
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("report.html", "plots"))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert main(["compare", str(a), str(b)]) == 0  # default: the first run's directory
    assert f"comparison written to {a / 'compare.html'} (plots in {a / 'compare_plots'})" in capsys.readouterr().out
    assert (a / "compare_plots" / "loss.png").is_file() and not list(cwd.iterdir())
    assert main(["compare", str(a), str(b), "--out", str(tmp_path / "out")]) == 0  # a directory
    assert (tmp_path / "out" / "compare.html").is_file() and (tmp_path / "out" / "compare_plots" / "loss.png").is_file()
    assert main(["compare", str(a), str(b), "--out", str(tmp_path / "ab.html")]) == 0  # a file
    assert (tmp_path / "ab.html").is_file() and (tmp_path / "ab_plots" / "loss.png").is_file()
    assert not list(cwd.iterdir())


# -- what the panels and the health line say ----------------------------------------------------------


def _figures_of(monkeypatch) -> list:
    """Spy on the report's PNG encoder: the matplotlib figures each plot was drawn from, in order."""
    from stabletrain.report import plots

    figs, real_png = [], plots._png
    monkeypatch.setattr(plots, "_png", lambda fig: figs.append(fig) or real_png(fig))
    return figs


def test_loss_scale_panel_only_where_a_loss_scale_is_in_play(real_run, other_run, run_copy, monkeypatch):
    figs = _figures_of(monkeypatch)
    names = [p.name for p in run_plots(load_run(real_run))]  # fp32, steps 12-13 skipped
    assert "loss_scale" not in names and "skipped" in names
    (ax,) = figs[names.index("skipped")].axes
    assert [b.get_height() for b in ax.patches if b.get_height() > 0] == [2.0]  # both skips in the interval 11-15
    page = write_report(real_run).read_text(encoding="utf-8")
    assert ("No loss-scale panel: fp32 trains without a loss scale (only fp16 runs a GradScaler); the skipped steps "
            "have their own panel.") in page
    names = [p.name for p in run_plots(load_run(other_run))]  # fp32, nothing skipped: neither panel, one line
    assert "loss_scale" not in names and "skipped" not in names
    assert "no step was skipped." in write_report(other_run).read_text(encoding="utf-8")

    # An fp16 run's files: its GradScaler's scale halves at the overflow and grows back.
    snapshot = json.loads((run_copy / "snapshot.json").read_text())
    (run_copy / "snapshot.json").write_text(json.dumps({**snapshot, "precision": "fp16"}))
    records, _ = read_jsonl(run_copy / "metrics.jsonl")
    scales = [65536.0, 65536.0, 16384.0, 16384.0, 16384.0, 32768.0, 32768.0, 32768.0]
    (run_copy / "metrics.jsonl").write_text("".join(json.dumps({**r, "loss_scale": s}) + "\n" for r, s in zip(records, scales)))
    events, _ = read_jsonl(run_copy / "events.jsonl")  # its skips (steps 12-13), at the scale of their interval
    (run_copy / "events.jsonl").write_text("".join(json.dumps({**e, "loss_scale": 16384.0} if e["kind"] == "skip" else e)
                                                   + "\n" for e in events))
    figs.clear()
    names = [p.name for p in run_plots(load_run(run_copy))]
    assert "loss_scale" in names and "skipped" not in names
    scale_ax = figs[names.index("loss_scale")].axes[0]
    assert list(scale_ax.get_lines()[0].get_ydata()) == scales and scale_ax.get_yscale() == "log"
    page = write_report(run_copy).read_text(encoding="utf-8")
    assert 'id="no-loss-scale"' not in page
    assert "skipped" in page and "; the fp16 loss scale went 65,536 -&gt; 32,768 (lowest 16,384)." in page  # (said)
    # A back-off within the first interval is in its skip events: the records alone (each an interval's last scale,
    # 64 throughout) said nothing of it
    (run_copy / "metrics.jsonl").write_text("".join(json.dumps({**r, "loss_scale": 64.0}) + "\n" for r in records))
    skips = iter([(1, 32768.0), (2, 16384.0)])
    (run_copy / "events.jsonl").write_text("".join(json.dumps(
        {**e, **dict(zip(("step", "loss_scale"), next(skips)))} if e["kind"] == "skip" else e) + "\n" for e in events))
    # (each skip event's scale is the one after its back-off: a trial read "went 32,768" as the scale it started at)
    assert "; the fp16 loss scale went after its first back-off 32,768 -&gt; 64 (lowest 64)." in write_report(
        run_copy).read_text(encoding="utf-8")
    # a scale past a million with every digit, as the smaller beside it (a trial read "8.38861e+06 -> 65,536")
    from stabletrain.report.text import scale_note

    rows = [{"step": 10, "loss_scale": 8388608.0}, {"step": 20, "loss_scale": 65536.0}, {"step": 30, "loss_scale": 2.0**-20}]
    assert scale_note(rows) == "; the fp16 loss scale went 8,388,608 -> 9.53674e-07 (lowest 9.53674e-07)"


def test_update_panel_draws_the_norm_and_the_ratio_on_separate_axes(real_run, monkeypatch):
    figs = _figures_of(monkeypatch)
    run = load_run(real_run)
    names = [p.name for p in run_plots(run)]
    top, bottom = figs[names.index("update")].axes  # two panels, no twin axis
    assert (top.get_ylabel(), bottom.get_ylabel()) == ("||Δθ|| (L2 norm)", "||Δθ|| / ||θ||")
    assert top.get_position().y0 > bottom.get_position().y1  # one above the other, not overlaid
    (norm,), (ratio,) = top.get_lines(), bottom.get_lines()
    assert list(norm.get_ydata()) == run.series("update_norm")[1]
    assert list(ratio.get_ydata()) == run.series("update_ratio")[1]


def _clip_run(tmp_path, rates, norms, peaks, optimizer="adamw", threshold=1.0, every=10, post=None, integration=None,
              stepped=None, losses=None, spikes=None):
    """A run directory holding only what the clip verdict reads: config and metrics, one record per interval
    (``post``: the post-clip norms; without them the record is one written before that key existed; ``integration``:
    an adapter's run)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.yaml").write_text((f"integration: {integration}\n" if integration else "")
                                          + f"clip:\n  max_norm: {threshold}\noptim:\n  name: {optimizer}\n")
    if stepped is not None:  # the optimizer the run stepped (a task's own), as snapshot.json records it
        (tmp_path / "snapshot.json").write_text(json.dumps({"optimizer": stepped}))
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": every * (i + 1), "loss": losses[i] if losses else 1.0, "clip_rate": r, "grad_norm": n,
                    "grad_norm_max": m,
                    **({"grad_norm_post_clip": post[i]} if post is not None else {}),
                    **({"num_spikes": spikes[i]} if spikes is not None else {})}) + "\n"
        for i, (r, n, m) in enumerate(zip(rates, norms, peaks))))
    return health_summary(load_run(tmp_path))


def _clip_sentence(h):
    return next((lvl, text) for lvl, text in h.sentences if text.startswith("Clipping fired on"))


def test_a_clip_that_fires_on_a_diverging_run_is_called_its_symptom_not_retuned(tmp_path):
    """A new user's LR jump: the loss climbed x1500 and the clip fired on every late step; the report advised 'set
    clip.max_norm to about 17' (a looser clip for a run diverging). The rise is the cause it names first."""
    h = _clip_run(tmp_path / "a", [0.1] * 4 + [1.0] * 6, [0.8] * 4 + [5.0, 9.0, 17.0, 30.0, 60.0, 90.0],
                  [1.2] * 4 + [17.0] * 6, losses=[1.0, 0.5, 0.2, 0.1, 0.3, 2.0, 9.0, 40.0, 90.0, 150.0])
    level, text = _clip_sentence(h)
    assert (level, h.figures["clip_verdict"]) == ("warn", "diverging"), text
    assert "the loss rose x1.5e+03 from its best interval (step 40, above), so the clip fires on gradients of a run " \
           "that got worse: a symptom, not the setting to tune first. Lower the learning rate (optim.lr)" in text, text
    assert "set clip.max_norm to about" not in text
    calm = _clip_run(tmp_path / "b", [0.1] * 4 + [1.0] * 6, [0.8] * 4 + [5.0] * 6, [1.2] * 4 + [17.0] * 6)
    assert calm.figures["clip_verdict"] == "most"  # (the same clip on a loss that did not rise: retune it)
    # A memorized dataset's loss at float32's floor: x40 of 1e-9 is no divergence against a descent from 2 (a review:
    # 'the loss rose x7.14 from its best interval's mean (1.043e-09 ...)' on the mlp over 64 samples)
    floor = _clip_run(tmp_path / "c", [0.1] * 4 + [1.0] * 6, [0.8] * 4 + [5.0] * 6, [1.2] * 4 + [17.0] * 6,
                      losses=[2.0, 1.0, 0.3, 0.01, 1e-4, 1e-6, 1e-9, 2e-9, 1e-8, 4e-8])
    assert "loss_rose" not in floor.figures and floor.figures["clip_verdict"] == "most"
    assert not any("it rose" in text for _, text in floor.sentences)


def test_the_typical_grad_norm_leaves_out_the_intervals_with_a_spike(tmp_path):
    """A trial: huge spikes in 3 of 6 intervals (norms ~5.5 otherwise) read 'the typical grad norm (median 187.3)' and
    'set clip.max_norm to about 1,825': the calm intervals' norms are the typical ones."""
    h = _clip_run(tmp_path / "a", [1.0] * 6, [448.8, 5.07, 5.49, 368.8, 5.84, 579.2], [3600, 8.0, 8.2, 3640, 9.88, 4000],
                  spikes=[1, 0, 0, 1, 0, 1])
    level, text = _clip_sentence(h)
    assert "the typical grad norm (median 5.49, the intervals without a loss spike or non-finite step)" in text, text
    assert "set clip.max_norm to about 8.2 (the median of each interval's largest grad norm)" in text, text
    calm = _clip_run(tmp_path / "b", [1.0] * 6, [5.0] * 6, [8.0] * 6, spikes=[0] * 6)  # (none left out: no note)
    assert "(median 5)" in _clip_sentence(calm)[1], _clip_sentence(calm)[1]


def test_the_clip_advice_of_a_run_whose_optimizer_is_unknown_names_none(tmp_path):
    """A config without optim.name and no snapshot: 'with None every gradient is rescaled to the same norm'."""
    run = tmp_path / "bare"
    run.mkdir()
    (run / "config.yaml").write_text("clip:\n  max_norm: 1.0\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": 10 * (i + 1), "loss": 1.0, "clip_rate": 1.0,
                                                           "grad_norm": 3.0, "grad_norm_max": 4.0}) + "\n" for i in range(6)))
    level, text = _clip_sentence(health_summary(load_run(run)))
    assert "with this optimizer every clipped gradient is rescaled to the same norm" in text and "None" not in text, text


def test_clip_rate_health_line_gives_a_verdict_with_its_reason(tmp_path):
    # The issue's run: 100% of the first 20 steps, 44% overall (30% of the rest), grad norms around the threshold.
    h = _clip_run(tmp_path / "a", [1.0, 1.0] + [0.3] * 8, [2.5, 1.8] + [0.95] * 8, [4.0, 2.2] + [1.6] * 8)
    level, text = _clip_sentence(h)
    assert h.figures["clip_rate"] == pytest.approx(0.44) and h.figures["clip_rate_late"] == pytest.approx(0.3)
    assert (level, h.figures["clip_verdict"]) == ("warn", "frequent")
    assert "30% in the second half: often" in text and "close to the typical grad norm (median 0.95)" in text
    assert "set clip.max_norm to about 1.6 (the median of each interval's largest grad norm)" in text

    # Most steps, to the end: the clip sizes the updates. AdamW and SGD are told what that does to each.
    adam = _clip_run(tmp_path / "b", [1.0] * 10, [2.5] * 10, [3.0] * 10)
    level, text = _clip_sentence(adam)
    assert (level, adam.figures["clip_verdict"]) == ("warn", "most") and "too often" in text
    assert "threshold is below the typical grad norm (median 2.5)" in text and "no longer tells a spike" in text
    sgd = _clip_run(tmp_path / "c", [1.0] * 10, [2.5] * 10, [3.0] * 10, optimizer="sgd")
    assert "as if the learning rate were about 0.4x as large" in _clip_sentence(sgd)[1]
    # An adapter records the optimizer's class ("AdamW", not "adamw"): Adam all the same (it was told "with SGD"),
    # and it is told its host's own keys, not the built-in loop's.
    lightning = _clip_sentence(_clip_run(tmp_path / "g", [1.0] * 10, [2.5] * 10, [3.0] * 10,
                                                     optimizer="AdamW", integration="lightning"))[1]
    assert "with Adam the update size barely changes" in lightning and "SGD" not in lightning
    assert "set Trainer(gradient_clip_val=) to about 3" in lightning and "clip.max_norm" not in lightning
    assert "lower the optimizer's lr instead" in lightning and "optim.lr" not in lightning
    hf = _clip_sentence(_clip_run(tmp_path / "h", [1.0] * 10, [2.5] * 10, [3.0] * 10, optimizer="SGD",
                                  integration="transformers"))[1]
    assert "with SGD the update shrinks" in hf and "TrainingArguments.max_grad_norm" in hf
    # A task's own optimizer (snapshot.json) is what stepped, whatever optim.name says: plain SGD is told SGD's effect
    task_sgd = _clip_sentence(_clip_run(tmp_path / "i", [1.0] * 10, [2.5] * 10, [3.0] * 10, stepped="JumpLR_SGD"))[1]
    assert "with SGD the update shrinks" in task_sgd and "Adam" not in task_sgd

    # Only the first steps (their large gradients): healthy; rarely or never: healthy.
    early = _clip_run(tmp_path / "d", [1.0, 1.0, 0.5] + [0.0] * 7, [3.0, 2.0, 1.1] + [0.5] * 7, [4.0, 3.0, 2.0] + [0.7] * 7)
    level, text = _clip_sentence(early)
    assert (level, early.figures["clip_verdict"]) == ("ok", "early") and "0% in the second half: healthy" in text
    rare = _clip_run(tmp_path / "e", [0.1] + [0.0] * 9, [0.5] * 10, [1.2] + [0.7] * 9)
    assert _clip_sentence(rare) == ("ok", "Clipping fired on 1% of steps (1 of 100; threshold 1): healthy, it trims "
                                          "the occasional large gradient.")
    never = _clip_run(tmp_path / "f", [0.0] * 10, [0.5] * 10, [0.7] * 10)
    assert _clip_sentence(never)[0] == "ok" and never.figures["clip_verdict"] == "never"


# The default run (`stabletrain train`: gpt, 300 steps, AdamW, clip.max_norm=1), its intervals as measured 2026-12-03.
DEFAULT_RUN = {
    "rates": [1.0, 1.0, 0.9, 0.5, 0.4, 0.2, 0.2, 0.6, 0.7, 0.6, 0.5, 0.5, 0.3, 0.4, 0.5, 0.2, 0.5, 0.6, 0.6, 0.3, 0.3, 0.6,
              0.3, 0.1, 0.2, 0.4, 0.2, 0.2, 0.1, 0.3],
    "norms": [4.312, 2.805, 1.669, 1.02, 0.939, 0.856, 0.873, 1.015, 1.064, 1.183, 0.94, 1.013, 0.892, 0.97, 1.026, 0.863,
              0.995, 1.03, 1.166, 0.972, 1.05, 0.958, 0.992, 0.801, 0.959, 1.087, 0.879, 0.898, 0.833, 0.9],
    "peaks": [7.314, 3.551, 2.322, 1.51, 1.27, 1.338, 1.311, 1.285, 1.411, 1.87, 1.474, 1.44, 1.187, 1.503, 1.505, 1.314,
              1.208, 1.426, 1.739, 1.268, 2.165, 1.218, 2.114, 1.017, 1.282, 1.597, 1.336, 1.165, 1.154, 1.277],
    "post": [1.0, 1.0, 0.993, 0.921, 0.888, 0.797, 0.833, 0.951, 0.943, 0.918, 0.858, 0.912, 0.854, 0.876, 0.909, 0.826,
             0.933, 0.938, 0.958, 0.921, 0.897, 0.903, 0.847, 0.8, 0.907, 0.921, 0.839, 0.871, 0.818, 0.868],
}


def test_the_default_runs_clipping_is_healthy_and_frequent_clipping_that_cuts_deep_is_not(tmp_path):
    # The newcomer's first report: 44% clipped, 33% in the second half, where the clip cuts the norm by a median 5%.
    h = _clip_run(tmp_path / "default", DEFAULT_RUN["rates"], DEFAULT_RUN["norms"], DEFAULT_RUN["peaks"],
                  post=DEFAULT_RUN["post"])
    level, text = _clip_sentence(h)
    assert (level, h.figures["clip_verdict"]) == ("ok", "trims")
    assert h.figures["clip_rate_late"] == pytest.approx(sum(DEFAULT_RUN["rates"][15:]) / 15)
    assert h.figures["clip_cut_late"] == pytest.approx(statistics.median(
        1 - post / pre for post, pre in zip(DEFAULT_RUN["post"][15:], DEFAULT_RUN["norms"][15:])))  # over the intervals
    assert 0.05 < h.figures["clip_cut_late"] < 0.06
    assert ("Clipping fired on 44% of steps (132 of 300; threshold 1), 33% in the second half, a median cut of 5% to the "
            "gradient norm there (over its log intervals): healthy.") in text
    assert "would need a look if its median cut of the late gradients reached 20%" in text

    # The same rates where the clip cuts a third of the late norm: the clip sizes the updates, worth a look.
    deep = _clip_run(tmp_path / "deep", [0.3] * 10, [1.5] * 10, [2.5] * 10, post=[1.0] * 10)
    level, text = _clip_sentence(deep)
    assert (level, deep.figures["clip_verdict"]) == ("warn", "frequent") and deep.figures["clip_cut_late"] == pytest.approx(1 / 3)
    assert "30% in the second half, a median cut of 33% to the gradient norm there (over its log intervals): often." in text
    # Nearly every step, by a little (norm 1.05 at a threshold of 1): trims; by a lot: too often.
    assert _clip_run(tmp_path / "edge", [0.9] * 10, [1.05] * 10, [1.2] * 10, post=[1.0] * 10).figures["clip_verdict"] == "trims"
    # Above the threshold over the run (the first intervals' large norms), near it late: the sentence says where it sat late
    # (it read "was above the threshold over the run, but in the second half and the clip trims its peaks")
    settled = _clip_run(tmp_path / "settled", [1.0] * 6 + [0.9] * 4, [3.0] * 6 + [1.05] * 4, [4.0] * 6 + [1.2] * 4,
                        post=[1.0] * 10)
    level, text = _clip_sentence(settled)
    assert (level, settled.figures["clip_verdict"]) == ("ok", "trims"), text
    assert ("The grad norm (median 3) was above the threshold over the run, but sits near or below it in the second half "
            "and the clip trims its peaks") in text, text
    most = _clip_run(tmp_path / "most", [1.0] * 10, [2.5] * 10, [3.0] * 10, post=[1.0] * 10)
    assert (_clip_sentence(most)[0], most.figures["clip_verdict"]) == ("warn", "most")


def _loss_run(tmp_path, means, lows, spikes=(), every=10):
    """A run directory with only its losses (interval means and smallest losses) and spike events."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.yaml").write_text("guard:\n  spike_ratio: 2.0\n")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": every * (i + 1), "loss": m, "loss_min": lo}) + "\n"
                                                    for i, (m, lo) in enumerate(zip(means, lows))))
    (tmp_path / "events.jsonl").write_text("".join(json.dumps({"step": s, "kind": "spike", "reason": "loss spike"}) + "\n"
                                                   for s in spikes))
    h = health_summary(load_run(tmp_path))
    return h, next(text for _, text in h.sentences if text.startswith("Train loss"))


def test_a_few_huge_losses_do_not_make_the_loss_headline_read_as_a_run_that_got_worse(tmp_path):
    # The issue's run: its typical loss fell from ~10,000 to ~2,000, but a spike lifted the last interval's mean to 33,228.
    typical = [10000.0, 8000.0, 6000.0, 4500.0, 3500.0, 3000.0, 2600.0, 2300.0, 2100.0, 2000.0]
    means = [11259.0, *typical[1:-1], 33228.0]
    h, text = _loss_run(tmp_path / "spiky", means, [9000.0, *[0.9 * t for t in typical[1:]]], spikes=[96])
    assert (h.figures["loss_first"], h.figures["loss_last"]) == (11259.0, 33228.0)  # the interval means, as recorded
    assert (h.figures["loss_start"], h.figures["loss_end"]) == (11259.0, 2600.0)  # the median of 33,228, 2,100,
                                                                                  # 2,300, 2,600, 3,000
    assert text.startswith("Train loss 11,259 → 2,600 (first interval → median of the last 5 intervals' means: the last "
                           "interval's mean, 33,228, is lifted by a loss spike at step 96)")
    # No spike event (the guard's window was still filling): the interval's smallest loss is typical, its mean is not.
    h, text = _loss_run(tmp_path / "unflagged", means, [9000.0, *[0.9 * t for t in typical[1:]]])
    assert h.figures["loss_end"] == 2600.0 and "is lifted by a few large losses" in text
    # A run that really got worse (every loss of the last intervals grew) keeps its last interval's mean.
    rising = [3.0, 2.5, 2.2, 2.1, 2.0, 2.4, 5.0, 40.0, 900.0, 5e4]
    h, text = _loss_run(tmp_path / "diverging", rising, [0.8 * m for m in rising])
    assert (h.figures["loss_start"], h.figures["loss_end"]) == (3.0, 5e4) and "(first → last interval)" in text
    assert text.endswith("; it rose x2.5e+04 from its best interval's mean, 2 at step 50."), text
    # ... also where the guard called its last steps spikes: each is high, no few large losses lift the mean (an LR
    # jumped 30x at step 150: "0.4184 → 0.02072 (... lifted by loss spikes at steps 161-170)" hid the divergence).
    means = [0.4184, 0.05, 0.03, 0.025, 0.021, 0.0207, 0.02, 0.021, 0.15, 0.3812]
    h, text = _loss_run(tmp_path / "jumped", means, [0.3, 0.04, 0.02, 0.02, 0.018, 0.018, 0.017, 0.018, 0.012, 0.147],
                        spikes=[*range(153, 158), *range(161, 171)], every=17)
    assert h.figures["loss_end"] == 0.3812 and "lifted" not in text, text
    assert text.endswith("(first → last interval); it rose x19.1 from its best interval's mean, 0.02 at step 119."), text
    assert ("warn", text) in h.sentences
    # ... and where the loss rose to a level and stayed (an LR warmup overshooting: the rule, its window frozen below,
    # flags every step after 69; the lows are high too, within x2 of the last intervals' median): "the last interval's
    # mean, 31.99, is lifted by loss spikes at steps 69-150" read as a few bad steps in a run at ~30.
    means = [4.26, 3.5, 3.4, 3.29, 3.3, 3.35, 7.6, 19.2, 24.0, 27.5, 29.0, 30.1, 30.5, 31.0, 31.99]
    lows = [3.6, 3.3, 3.2, 3.1, 3.1, 3.2, 3.3, 15.0, 20.0, 22.0, 24.0, 25.0, 25.5, 26.0, 27.0]
    h, text = _loss_run(tmp_path / "level", means, lows, spikes=range(69, 151))
    assert h.figures["loss_end"] == 31.99 and "lifted" not in text, text
    assert text.endswith("(first → last interval); it rose x9.72 from its best interval's mean, 3.29 at step 40."), text
    # Spikes that recur (a bad sample each epoch) lift most of the first intervals' means: their median would be lifted
    # too; the intervals without a spike tell the typical loss.
    means = [40.0, 1.0, 30.0, 0.8, 25.0, 0.5, 0.4, 0.3]
    h, text = _loss_run(tmp_path / "recurring", means, [1.2, 0.9, 0.7, 0.7, 0.5, 0.4, 0.35, 0.25], spikes=[5, 25, 45])
    assert h.figures["loss_start"] == 0.9 and text.startswith(
        "Train loss 0.9 → 0.3 (median of the means of the 2 of the first 4 intervals without a loss spike → last "
        "interval: the first interval's mean, 40, is lifted by a loss spike at step 5)"), text
    # ... but not where the intervals with spikes are high throughout (an LR x30 at step 80: the loss rose and stayed;
    # 'the median of the means of the 2 of the last 5 intervals without a loss spike', 0.1542, from before it)
    means = [1.0, 0.5, 0.3, 0.2, 0.17, 0.15, 0.144, 0.165, 2.18, 1.59, 1.181]
    lows = [0.8, 0.4, 0.25, 0.18, 0.15, 0.13, 0.12, 0.14, 0.9, 0.6, 0.3906]
    h, text = _loss_run(tmp_path / "risen", means, lows, spikes=[81, 82, 84, 85, 95, 105])
    assert h.figures["loss_end"] == 1.181 and "lifted" not in text and "without a loss spike" not in text, text
    # A short run (6 intervals): each end's median is over its own 3 intervals, never the same ones ("0.13 → 0.13").
    means = [9.0, 0.5, 0.4, 0.2, 0.1, 7.0]
    h, text = _loss_run(tmp_path / "short", means, [0.4, 0.45, 0.35, 0.18, 0.09, 0.08], spikes=[5, 60])
    assert (h.figures["loss_start"], h.figures["loss_end"]) == (0.5, 0.2), text
    # One interval: its mean at both ends (no median of nothing), said once, with what lifted it
    h, text = _loss_run(tmp_path / "one", [2.5], [1.0], spikes=[4])
    assert (h.figures["loss_start"], h.figures["loss_end"]) == (2.5, 2.5), text
    assert text == "Train loss 2.5 (one interval) (the only interval's mean, 2.5, is lifted by a loss spike at step 4).", text
    _loss_run(tmp_path / "early", [2.5], [1.0])  # the same with an early outlier, not a spike (a review: 'a few large losses')
    (tmp_path / "early" / "events.jsonl").write_text(json.dumps({"step": 4, "kind": "early_outlier", "reason": "...",
                                                                 "loss": 20.0, "factor": 20.0}) + "\n")
    text = next(t for _, t in health_summary(load_run(tmp_path / "early")).sentences if t.startswith("Train loss"))
    assert text == ("Train loss 2.5 (one interval) (the only interval's mean, 2.5, is lifted by an early outlier at step 4 "
                    "(before the spike rule armed))."), text
    # Two intervals, a spike in the first: too few for a median; the mean stands and the words say what lifted it
    h, text = _loss_run(tmp_path / "two", [564.0, 0.14], [0.3, 0.1], spikes=[7])
    assert text.startswith("Train loss 564 → 0.14 (first interval → last interval: the first interval's mean, 564, is "
                           "lifted by a loss spike at step 7)"), text
    # A spike in the last interval of a loss still falling: the intervals before it are higher than its mean, which
    # stands ("the last interval's mean, 0.008788, is lifted by loss spikes" gave way to 0.009096, a trial's)
    means = [1.573, 0.5, 0.1, 0.03, 0.0102, 0.0091, 0.0082, 0.008788]
    h, text = _loss_run(tmp_path / "still-falling", means, [0.9 * m for m in means], spikes=[75, 76])
    assert h.figures["loss_end"] == 0.008788 and "lifted" not in text, text
    # A loss that falls fast at the start keeps its first interval's mean too.
    falling = [5.1, 1.3, 0.22, 0.03, 0.0005, 1e-4, 3e-5, 1e-5]
    h, text = _loss_run(tmp_path / "falling", falling, [0.5 * m for m in falling])
    assert h.figures["loss_start"] == 5.1 and "(first → last interval)" in text


def test_a_runs_first_interval_that_falls_fast_within_it_heads_the_loss_unless_a_spike_or_early_outlier_lifts_it(tmp_path):
    """34 -> 0.04 within the first 10 steps: the first interval's mean, 11.02, was 'lifted by a few large losses' and the
    headline started at the median of the first 5 intervals, 0.1259: not where the run started."""
    means, lows = [11.02, 0.9, 0.13, 0.12, 0.1259, 0.11, 0.05, 0.03, 0.02, 0.014], [0.04, 0.1, 0.1, 0.1, 0.1, 0.09, 0.04,
                                                                                     0.02, 0.015, 0.01]
    h, text = _loss_run(tmp_path / "warm", means, lows)
    assert h.figures["loss_start"] == 11.02 and "lifted" not in text, text
    # an early outlier in it (a bad batch before the rule arms) still lifts it
    (tmp_path / "warm" / "events.jsonl").write_text(json.dumps({"step": 6, "kind": "early_outlier", "reason": "...",
                                                                "loss": 100.0, "factor": 40.0}) + "\n")
    h = health_summary(load_run(tmp_path / "warm"))
    text = next(text for _, text in h.sentences if text.startswith("Train loss"))
    assert h.figures["loss_start"] == 0.13 and ("the first interval's mean, 11.02, is lifted by an early outlier at step 6 "
                                                "(before the spike rule armed)") in text, text  # (a trial: 'a loss spike')


def test_a_loss_that_fell_to_its_last_interval_is_not_said_to_have_risen_from_its_best(tmp_path):
    """The README's spike example: the last interval lifted by its spike, the end read as the median of the last 4
    intervals' means (0.001785, reaching back to where the loss was still falling), and 'it rose x3.71 from its best
    interval's mean, 0.0004816 at step 70' for a loss that only fell (the last interval's smallest, 0.00068)."""
    means = [0.1629, 0.05, 0.02, 0.008, 0.00237, 0.0012, 0.0004816, 0.35]
    lows = [0.05, 0.02, 0.01, 0.004, 0.0015, 0.0008, 0.0003, 0.00068]
    h, text = _loss_run(tmp_path / "fell", means, lows, spikes=[78])
    assert "lifted by a loss spike at step 78" in text and "rose" not in text, text
    # one whose last interval's smallest loss did rise: said by that loss's own factor (not the median's, below the bar)
    h, text = _loss_run(tmp_path / "rose", means, [*lows[:-1], 0.002], spikes=[78])
    assert text.endswith("; it rose x4.15 (its last interval's smallest loss, 0.002) from its best interval's mean, "
                         "0.0004816 at step 70."), text


def test_a_short_runs_end_without_its_spike_steps_own_losses_not_a_median_reaching_back_to_the_start(tmp_path):
    """Three intervals (a Monitor run of 30 steps, 3 samples x100 at step 27): the median of the last 3 intervals' means
    was the first's: 'Train loss 10.39 -> 10.39; it rose x2.51 from its best interval's mean' for a loss that fell."""
    run = tmp_path / "late"
    run.mkdir()
    (run / "config.yaml").write_text("guard:\n  spike_ratio: 2.0\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": 10 * (i + 1), "interval_steps": 10, "loss": m,
                                                           "loss_min": lo}) + "\n"
                                               for i, (m, lo) in enumerate([(10.39, 3.2), (4.143, 1.9), (1328.0, 0.224)])))
    (run / "events.jsonl").write_text(json.dumps({"step": 27, "kind": "spike", "reason": "loss spike", "loss": 13270.0}) + "\n")
    h = health_summary(load_run(run))
    text = next(t for _, t in h.sentences if t.startswith("Train loss"))
    assert h.figures["loss_end"] == pytest.approx((13280.0 - 13270.0) / 9)
    assert text.startswith("Train loss 10.39 → 1.111 (first interval → last interval without its spike step: the last "
                           "interval's mean, 1,328, is lifted by a loss spike at step 27)") and "rose" not in text, text


def test_a_real_run_with_a_huge_loss_heads_with_its_typical_loss(tmp_path):
    # Step 38 of a real 40-step run has its loss x 1e4 (a spike by the guard's rule): the last interval's mean is
    # ~1e3 times the others', while its other steps are as typical as theirs.
    run = make_run(tmp_path / "run", ["clip.max_norm=1.0"], bad_steps=(38,), factor=1e4)
    h = health_summary(load_run(run))
    records, _ = read_jsonl(run / "metrics.jsonl")
    means = [r["loss"] for r in records]
    assert h.figures["spike_steps"] == [38] and means[-1] > 100 * means[-2]
    ends = min(5, len(means) // 2)  # the last 5 intervals, fewer where they would overlap the first ones
    assert ends >= 3 and h.figures["loss_last"] == means[-1]
    assert h.figures["loss_end"] == pytest.approx(statistics.median(means[-ends:]))
    text = next(t for _, t in h.sentences if t.startswith("Train loss"))
    assert text.startswith(f"Train loss {fmt_num(means[0])} → {fmt_num(h.figures['loss_end'])} (first interval → median "
                           f"of the last {ends} intervals' means: the last interval's mean, {fmt_num(means[-1])}, is lifted "
                           "by a loss spike at step 38)")
    assert h.figures["loss_end"] < means[0]  # the run's typical loss fell; the interval means alone said it rose


def test_a_remedy_that_rolled_back_is_in_the_health_summary_with_what_it_undid(tmp_path, monkeypatch, capsys):
    # The README's diverging run under guard.on_nonfinite=remedy: incident at 38, steps 38-40 skipped, then the remedy
    # rolls back to step 0 with lr x0.1 and the run ends healthy. The summary says all of it, not "No incidents".
    from stabletrain.cli import main

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    assert main(["train", "task=examples.diverging_task:make_task", "optim.name=sgd", "optim.lr=2.5",
                 "optim.weight_decay=0", "clip.max_norm=null", "sched.decay=constant", "train.batch_size=8",
                 "train.max_steps=60", "log.every=5", "ckpt.every=10", "ckpt.keep=10", "data.shuffle=false",
                 "guard.on_nonfinite=remedy", "remedy.steps=4", "log.progress=false", "log.tensorboard=false",
                 f"run.dir={tmp_path / 'run'}"]) == 0
    # the final line says what the run went through: the remedy applied (its rollback is the remedy's, not the guard's)
    (last,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("stabletrain: trained 60 steps")]
    assert "; applied a remedy (events.jsonl); run directory: " in last and "rolled back" not in last, last
    run = load_run(tmp_path / "run")
    h = health_summary(run)
    text = h.text
    assert h.level == "warn" and not run.counted_events("incident")  # the incidents were rolled back past
    undone = dict(h.figures["incidents_undone"])  # the divergence at 38 (and the spikes its growth made before it)
    assert undone[38].startswith("divergence")
    n = len(undone)
    assert f"{n} incident{'s' if n > 1 else ''} before the remedy's rollback (the run went back and trained that " \
           "stretch again): at step " in text
    from stabletrain.report.health import first_clause

    # 5 are listed (of several, each one's class and first clause); a divergence's burst of state spikes before the
    # non-finite step is now one capture (its course is not captured again)
    head = undone[38] if n == 1 else first_clause(undone[38])
    assert f"at step 38, {head.rstrip('.')}" in text if n <= 5 else f"; and {n - 5} more." in text
    assert h.figures["skip_steps_undone"] == [38, 39, 40] and h.figures["skipped_steps"] == 0
    assert ("No steps skipped since the remedy's rollback; before it 3 steps were skipped at 38-40 (non-finite loss or "
            "grad norm), and that stretch was trained again.") in text
    (remedy,) = h.figures["remedies"]
    assert (remedy["name"], remedy["at_step"], remedy["from_step"]) == ("rollback-lr-x0.1", 0, 40)
    assert ("Remedy applied: rollback-lr-x0.1 (back to step 0, lr x0.1) for the divergence incident at step 38, cures on "
            "a replay; at step 40 the run went back to step 0 and trained on from there with it.") in text
    assert "No incidents." not in text and "No steps skipped." not in text
    page = write_report(tmp_path / "run").read_text(encoding="utf-8")
    assert '<span class="badge warn">worth a look</span>' in page and "Remedy applied: rollback-lr-x0.1" in page
    assert "a remedy rolled the run back past this step" in page  # the timeline says why the incident's row is grey
    assert re.search(r"saved step_000010 \(\d+\.\d KiB, verified\)", page)  # a small checkpoint: KiB, not "0.0 MiB"


def test_the_spike_line_says_when_the_runs_spike_captures_were_spent(run_copy):
    append_events(run_copy, *({"step": s, "kind": "spike", "reason": f"loss spike: {s}", "loss": 9.0} for s in range(20, 31)),
                  *({"step": s, "kind": "incident", "reason": f"captured the loss spike at step {s}", "anomaly": "spike"}
                    for s in (20, 22, 24, 26, 28)))
    h = health_summary(load_run(run_copy))
    assert ("warn", "11 loss spikes at step 20-30; capture.max_spikes=5 was spent at step 28: the 2 spikes after it went "
                    "uncaptured.") in h.sentences


def test_remedies_not_applied_for_the_same_reason_are_one_line(run_copy):
    why = ("the incident was not captured (the run's spike captures are spent: capture.max_spikes=5); falling back to "
           "remedy.fallback=skip")
    cause = why.removesuffix("; falling back to remedy.fallback=skip")  # as the run's events hold them
    append_events(run_copy, *({"step": s + 1, "kind": "remedy", "reason": f"no remedy applied for the incident at step {s}: "
                               f"{why}", "applied": None, "incident_step": s, "why": cause, "fallback": "skip"}
                              for s in (17, 23, 31)),
                  {"step": 36, "kind": "remedy", "reason": "no remedy applied for the incident at step 35: no candidate "
                   "cures it (skip-step: fails); falling back to remedy.fallback=skip", "applied": None,
                   "incident_step": 35, "why": "no candidate cures it (skip-step: fails)", "fallback": "skip"})
    h = health_summary(load_run(run_copy))
    lines = [t for _, t in h.sentences if t.startswith("No remedy applied")]
    assert lines == [f"No remedy applied for the incidents at steps 17, 23, 31: {why}.",
                     "No remedy applied for the incident at step 35: no candidate cures it (skip-step: fails); falling "
                     "back to remedy.fallback=skip."], lines
    assert len(h.figures["remedies"]) == 4


def test_the_health_summary_says_a_runs_early_outliers_which_no_incident_covers(tmp_path):
    """lr=3 with no clip: the mlp's loss jumps x1e4-1e5 at step 2, before the spike rule arms: an early_outlier event in
    the timeline only, and the summary said "No incidents" and nothing of it."""
    from helpers import cfg

    from stabletrain import Trainer
    from stabletrain.report.health import health_summary
    from stabletrain.report.rundata import load_run

    Trainer(cfg("train.max_steps=6", "log.every=6", "optim.lr=3", "sched.warmup_steps=0", "sched.decay=constant",
                "clip.max_norm=null"), run_dir=tmp_path / "run").fit()
    run = load_run(tmp_path / "run")
    [event] = run.counted_events("early_outlier")
    h = health_summary(run)
    [said] = [text for level, text in h.sentences if level == "warn" and "early outlier" in text]
    assert said.startswith(f"1 early outlier before the spike rule armed: step {event.step} (loss ") and \
        "may be diverging from the start (an LR too high for it?)." in said, said
    assert h.figures["early_outlier_steps"] == [event.step]
    # One on step 1, told against the losses after it (a trial: it read "every loss before it", of which it has none)
    events = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    (tmp_path / "run" / "events.jsonl").write_text("".join(json.dumps(
        {**e, "step": 1, "against": "the median of the losses after it (to step 5)"} if e["kind"] == "early_outlier" else e)
        + "\n" for e in events))
    [said] = [text for level, text in health_summary(load_run(tmp_path / "run")).sentences
              if level == "warn" and "early outlier" in text]
    assert "step 1 (loss " in said and "the median of the losses after it (to step 5))" in said and \
        "every loss before it" not in said.split(";")[0] and "its batch (a corrupted sample?)" in said, said
    # one weighed against the counted losses past an outlier held out before it is still one above those before it
    (tmp_path / "run" / "events.jsonl").write_text("".join(json.dumps(
        {**e, "against": "the largest loss before it (but step 1's, itself an outlier)"} if e["kind"] == "early_outlier"
        else e) + "\n" for e in events))
    [said] = [text for level, text in health_summary(load_run(tmp_path / "run")).sentences
              if level == "warn" and "early outlier" in text]
    assert "may be diverging from the start (an LR too high for it?)" in said, said


def test_an_early_outlier_whose_loss_came_back_is_told_as_a_one_off_not_a_divergence(tmp_path):
    """A new user's case: two samples of step 3 with targets x1000 (loss x1e5 at step 3, the level again from step 4):
    the report said "may be diverging from the start (an LR too high for it?)", which its own next interval refutes."""
    from helpers import cfg
    from spike_tasks import outlier_samples_task

    from stabletrain import Trainer
    from stabletrain.report.health import health_summary
    from stabletrain.report.rundata import load_run

    Trainer(cfg("train.batch_size=8", "data.shuffle=false", "train.max_steps=20", "log.every=10", "optim.lr=0.01"),
            task=outlier_samples_task(bad=(18, 21), scale=1000.0), run_dir=tmp_path / "run").fit()
    run = load_run(tmp_path / "run")
    [event] = run.counted_events("early_outlier")
    [said] = [text for level, text in health_summary(run).sentences if level == "warn" and "early outlier" in text]
    later = next(r for r in run.metrics if r["step"] == 20)
    assert event.step == 3 and later["loss"] < 2 * event.extra["loss"] / event.extra["factor"], (event, later)
    assert f"the loss was back by the next log interval ({fmt_num(later['loss'])} at step 20): a one-off step" in said, said
    assert "diverging" not in said, said
    # ... and where the same corruption comes back as a spike in the next interval (a trial: its mean, lifted by the
    # spike, read as the loss staying up: 'may be diverging'), by the next interval without one
    Trainer(cfg("train.batch_size=8", "data.shuffle=false", "train.max_steps=30", "log.every=10", "optim.lr=0.01"),
            task=outlier_samples_task(bad=(18, 21, 150, 151), scale=1000.0), run_dir=tmp_path / "again").fit()
    run = load_run(tmp_path / "again")
    assert [e.step for e in run.counted_events("spike")] == [19]
    [said] = [text for level, text in health_summary(run).sentences if level == "warn" and "early outlier" in text]
    assert ("the loss was back by the next log interval without a loss spike (" in said and "at step 30): its batch (a "
            "corrupted sample?), not a divergence; the loss spikes between may be that data again" in said), said
    assert "diverging" not in said and "one-off" not in said, said


def test_the_health_summary_says_what_the_init_report_found_at_step_0(tmp_path):
    from helpers import cfg

    from stabletrain import Trainer
    from stabletrain.report.health import health_summary
    from stabletrain.report.rundata import load_run

    for name, extra in (("ok", []), ("deep", ["task_args.depth=12"])):
        Trainer(cfg("train.max_steps=2", "log.every=1", *extra), run_dir=tmp_path / name).fit()
    ok, deep = (health_summary(load_run(tmp_path / n)) for n in ("ok", "deep"))
    assert ("ok", "At step 0 the signal held through every layer, forward and backward.") in ok.sentences
    assert ok.figures["init_signal_passed"] is True and deep.figures["init_signal_passed"] is False
    said = [text for level, text in deep.sentences if text.startswith("At step 0 ")]
    assert len(said) == 1 and "forward: vanishes at #5" in said[0] and "init_(model, 'kaiming')" in said[0]
    assert ("warn", said[0]) in deep.sentences


def test_spikes_and_incidents_a_rollback_went_back_past_are_said_once_each(tmp_path):
    """A state that spikes at the same step after each of 3 rollbacks, then trains past it: the summary says the
    spikes before the rollback (not nothing), and the incident once with how often it was met (not 3 times)."""
    (tmp_path / "config.yaml").write_text("train:\n  max_steps: 100\n")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(10, 101, 10)))
    events = []
    for share in (99, 98, 97):  # the evidence's numbers differ a little each time
        diagnosis = {"summary": f"data: samples 3, 11 carry {share}% of the window's loss"}
        events += [{"step": 65, "kind": "spike", "reason": "loss spike"},
                   {"step": 65, "kind": "incident", "reason": "spike", "anomaly": "spike", "diagnosis": diagnosis},
                   {"step": 60, "kind": "rollback", "reason": "loss spike at step 65: rolled back"}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    h = health_summary(load_run(tmp_path))
    texts = [t for _, t in h.sentences]
    assert "No loss spikes since the rollback; before it, 1 loss spike at step 65." in texts, texts
    undone = next(t for t in texts if t.startswith("1 incident before the rollback"))
    assert undone.count("at step 65") == 1 and "(met 3 times)" in undone, undone


def test_the_remedies_section_marks_a_search_a_restart_went_back_past(tmp_path):
    _loss_run(tmp_path, [1.0, 0.5, 0.4], [0.9, 0.4, 0.3])
    record = {"step": 45, "failure_class": "data", "evidence": "samples 3, 11", "steps": 20, "best": "skip-samples",
              "later_incident": 63, "timings": {"steps_replayed": 40, "total_s": 0.5},
              "candidates": [{"name": "skip-samples", "verdict": "cures", "end_loss": 0.02, "detail": "drop 3, 11",
                              "evidence": "steps 45-62 finite"}]}
    for name in ("step_000045.superseded-1", "step_000045"):
        (tmp_path / "incidents" / name).mkdir(parents=True)
        (tmp_path / "incidents" / name / "remedy.json").write_text(json.dumps(record))
    text = html.unescape(write_report(tmp_path).read_text(encoding="utf-8"))
    assert text.count("<h3>Step 45: data") == 2
    assert text.count("(superseded: restart 1 went back past it; step_000045.superseded-1)") == 1
    assert text.count("judged up to step 62: every candidate past it met a later incident at step 63 alike") == 2


def test_an_incident_whose_folder_a_restart_renamed_points_to_where_it_is(tmp_path):
    _loss_run(tmp_path, [1.0, 0.5, 0.4], [0.9, 0.4, 0.3])
    folder = tmp_path / "incidents" / "step_000015"
    (tmp_path / "incidents" / "step_000015.superseded-1").mkdir(parents=True)
    (tmp_path / "events.jsonl").write_text(json.dumps({"step": 15, "kind": "incident", "time": 1.0, "path": str(folder),
                                                       "reason": f"captured the loss spike at step 15 into {folder}"}) + "\n")
    text = html.unescape(write_report(tmp_path).read_text(encoding="utf-8"))
    assert f"its folder is now {folder}.superseded-1 (a restart went back past it)" in text


def test_a_spike_a_rollback_went_back_past_stays_on_the_loss_and_grad_norm_plots(tmp_path, monkeypatch):
    """After a rollback the curves held only the retrained history: the spike that caused it (loss 5.2) was on no
    plot. The superseded records that differ from the kept ones are drawn faded, with their interval's range; a
    resume's bitwise repeats are not."""
    row = {"loss": 1.3, "loss_min": 1.2, "loss_max": 1.4, "grad_norm": 1.0, "grad_norm_max": 1.5}
    kept = [{"step": s, **row} for s in (10, 20, 30, 40)]
    (tmp_path / "config.yaml").write_text("clip:\n  max_norm: 1.0\n")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    superseded = [{"step": 30, **row}, {"step": 40, **row, "loss": 1.72, "loss_max": 5.2, "grad_norm_max": 40.0},
                  {"step": 20, **row, "loss": 1.31, "superseded_by": "resume"}]  # a resume's (a GPU's last bits)
    (tmp_path / "metrics.superseded.jsonl").write_text("".join(json.dumps(r) + "\n" for r in superseded))
    run = load_run(tmp_path)
    assert [(r["step"], r["loss"]) for r in run.abandoned] == [(40, 1.72)]  # step 30: a resume's repeat, not drawn
    figs = _figures_of(monkeypatch)
    names = [p.name for p in run_plots(run)]
    for name, top in (("loss", 5.2), ("grad_norm", 40.0)):
        ax = figs[names.index(name)].axes[0]
        (faded,) = [line for line in ax.get_lines() if line.get_label() == "before a rollback (trained again)"]
        assert list(faded.get_xdata()) == [40] and ax.get_ylim()[1] >= top
        # the scale holds them: grad norms of 1-1.5 beside the abandoned 40 span over 20x, a log axis (not a flat line)
        assert ax.get_yscale() == ("log" if name == "grad_norm" else "linear")


@pytest.mark.parametrize("verdict,incident,level", [("cures", "own", "warn"), ("fails", "own", "bad"),
                                                    ("cures", "other", "bad")])
def test_an_incident_reads_cured_only_for_a_remedy_that_cured_it_in_this_run(tmp_path, verdict, incident, level):
    """A remedy applied by hand (remedy.apply=DIR:N) may be a row that fails, or come from another run's incident at the
    same step: neither makes this run's incident 'cured'."""
    run = tmp_path / "run"
    (run / "incidents" / "step_000051").mkdir(parents=True)
    (run / "config.yaml").write_text("clip:\n  max_norm: 1.0\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 60, "loss": 1.0}) + "\n")
    folder = run / "incidents" / "step_000051" if incident == "own" else tmp_path / "elsewhere" / "incidents" / "step_000051"
    events = [{"step": 51, "kind": "incident", "reason": "captured the loss spike at step 51"},
              {"step": 60, "kind": "remedy", "reason": "applied", "name": "lr-x0.1", "verdict": verdict,
               "incident": str(folder), "incident_step": 51, "failure_class": "data", "at_step": 60, "from_step": 60}]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    health = health_summary(load_run(run))
    (said,) = [(lvl, t) for lvl, t in health.sentences if t.startswith("1 incident")]
    assert said[0] == level and (("cured" in said[1]) == (level == "warn")), said


def test_precursor_warnings_are_in_the_health_summary_with_the_spike_each_came_before(tmp_path):
    """The console said 'precursor at step N'; the report said nothing of it (the events table only)."""
    h, _ = _loss_run(tmp_path / "run", [1.0, 0.9, 0.8, 0.7], [0.9, 0.8, 0.7, 0.6], spikes=[37])
    events = (tmp_path / "run" / "events.jsonl").read_text() + "".join(
        json.dumps({"step": s, "kind": "precursor", "reason": "update/weight ratio departs"}) + "\n" for s in (20, 30))
    (tmp_path / "run" / "events.jsonl").write_text(events)
    h = health_summary(load_run(tmp_path / "run"))
    assert h.figures["precursor_steps"] == [20, 30]
    assert ("ok", "2 precursor warnings (a layer's update/weight ratio departed from its history) at step 20 (17 steps "
                  "before the spike at step 37); step 30 (7 steps before the spike at step 37).") in h.sentences
    # A rollback to step 30 went back past the spike (undone, trained again without it): it still followed the warning
    # at step 20 and the one at 30 (they read 'no spike followed').
    (tmp_path / "run" / "events.jsonl").write_text(events + json.dumps({"step": 30, "kind": "rollback", "reason": "back"})
                                                   + "\n")
    h = health_summary(load_run(tmp_path / "run"))
    assert ("ok", "2 precursor warnings (a layer's update/weight ratio departed from its history) at step 20 (17 steps "
                  "before the spike at step 37, which the run went back past); step 30 (7 steps before the spike at step "
                  "37, which the run went back past).") in h.sentences, h.sentences
    # A warning near the run's end with no spike after it: the run ended 20 steps on (it read 'within 100 steps')
    (tmp_path / "run" / "events.jsonl").write_text(json.dumps({"step": 20, "kind": "precursor", "reason": "departs"}) + "\n")
    h = health_summary(load_run(tmp_path / "run"))
    assert any("at step 20 (no spike followed in the 20 steps the run went on)" in t for _, t in h.sentences), h.sentences


def test_several_incidents_are_listed_by_their_class_and_headline_only(tmp_path):
    from stabletrain.report.health import _listed

    long = "state: the model or optimizer state drifted (a divergence onset, or an LR too high); the LR rose x30; more"
    assert _listed([(5, long)]) == f"at step 5, {long}"
    assert _listed([(5, long), (9, "data: samples 1, 2 carry 90%; without them the step is normal")]) == (
        "at step 5, state: the model or optimizer state drifted (a divergence onset, or an LR too high); at step 9, data: "
        "samples 1, 2 carry 90%")
    # a clause's own aside keeps its brackets: it was cut at the "; " inside them ('... (61% of it gone; at step 125')
    aside = "data: the whole window is high (the search: 61% of it gone; dropout off); more"
    assert _listed([(5, aside), (9, long)]).startswith(
        "at step 5, data: the whole window is high (the search: 61% of it gone; dropout off); at step 9, state: ")


def test_the_loss_plot_marks_each_spike_at_its_own_step_and_loss(tmp_path):
    """The curve holds interval means at the intervals' ends: a spike at step 37 showed at 40 (where a remedy's line
    may stand, as if the remedy had made it). Its event's own loss is marked at its step."""
    from stabletrain.report.plots import run_plots, spike_points

    _loss_run(tmp_path / "run", [1.0, 0.9, 0.8, 3.0], [0.9, 0.8, 0.7, 0.6], spikes=[])
    (tmp_path / "run" / "events.jsonl").write_text(json.dumps({"step": 37, "kind": "spike", "reason": "loss spike",
                                                               "loss": 12.5}) + "\n")
    run = load_run(tmp_path / "run")
    assert spike_points(run) == [(37, 12.5)]
    assert run_plots(run)[0].name == "loss"



def test_a_best_interval_loss_of_zero_or_below_says_no_rise_and_does_not_crash(tmp_path):
    h, text = _loss_run(tmp_path / "zero", [1.0, 0.5, 0.0, 0.2], [0.9, 0.4, 0.0, 0.1])
    assert "rose" not in text, text
    h, text = _loss_run(tmp_path / "negative", [-0.2, -1.0, -0.8, -0.5], [-0.3, -1.1, -0.9, -0.6])
    assert "rose" not in text, text


def test_the_run_clip_rate_weighs_each_interval_by_its_applied_steps(tmp_path):
    """clip_rate is over an interval's applied steps: an interval of 10 steps with 9 skipped and its one applied step
    clipped counts 1 clipped of 1, not 10 of 10."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.yaml").write_text("clip:\n  max_norm: 1.0\n")
    rows = [{"step": 10, "loss": 1.0, "interval_steps": 10, "clip_rate": 0.0, "num_skipped": 0},
            {"step": 20, "loss": 1.0, "interval_steps": 10, "clip_rate": 1.0, "num_skipped": 9}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    h = health_summary(load_run(tmp_path))
    assert (h.figures["clipped_steps"], h.figures["clip_steps_seen"]) == (1, 11)


def test_data_spikes_each_on_other_single_samples_are_said_to_be_a_heavy_tail():
    """A healthy regression with Student-t noise at batch 4 spent every capture on natural tail samples and read as
    'problems' with nothing to say why: 3+ data spikes, each one or two samples, none twice, get the hint."""
    from stabletrain.report.health import _scattered
    from stabletrain.report.rundata import Event

    def spike(step, samples, cls="data"):
        return Event(step, "incident", "", None, {"anomaly": "spike", "diagnosis": {"failure_class": cls,
                                                                                    "bad_samples": samples}})

    tail = [spike(94, [371]), spike(125, [498, 501]), spike(166, [662])]
    assert _scattered(tail).startswith(" 3 data spikes each carried by one or two samples, never the same: a loss with a "
                                       "heavy tail (noisy targets or labels, a small batch)")
    assert _scattered(tail[:2]) == ""  # two are no pattern
    assert _scattered([*tail[:2], spike(166, [371])]) == ""  # the same sample again: it comes back, a bad sample
    assert _scattered([*tail[:2], spike(166, None, "state")]) == ""
    assert _scattered([*tail[:2], spike(166, [1, 2, 3])]) == ""  # a few samples together: a bad batch's
    # Planted corrupt samples read as a heavy tail (a trial): each at 1e4 x the median, in a run of under one epoch or
    # with the samples dropped, so they could not come back. A gross outlier is no tail; the samples must have had an
    # epoch to come back in, and not been dropped.
    from types import SimpleNamespace

    gross = [Event(e.step, e.kind, "", None, {**e.extra, "diagnosis": {**e.extra["diagnosis"], "spike_test": {"ratio": r}}})
             for e, r in zip(tail, (4.0, 2e4, 5.0))]
    assert _scattered(gross) == "" and _scattered(gross[:1] + [tail[1]] + gross[2:]).startswith(" 3 data spikes")
    tail = [Event(e.step, e.kind, "", None, {**e.extra, "diagnosis": {**e.extra["diagnosis"], "epoch": 0}}) for e in tail]

    def run(last_epoch, events=()):
        return SimpleNamespace(metrics=[{"epoch": 0}, {"epoch": last_epoch}],
                               counted_events=lambda *kinds: [e for e in events if e.kind in kinds])

    assert _scattered(tail, run(2)).startswith(" 3 data spikes") and _scattered(tail, run(0)) == ""
    drop = Event(130, "remedy", "", None, {"remedy": {"kind": "skip-samples", "samples": [498, 501]}})
    assert _scattered(tail, run(2, [drop])) == ""


#: The stall guard's reason for fp16tasks' tiny task (a loss of ~1e-14: its gradients underflow float16 to 0 at any scale).
STALL_REASON = ("the run is stalled at step 20: 0 of the last 20 steps were skipped and the 20 applied had a zero gradient; the "
                "GradScaler's scale is 6.6e+04: in float16 the gradients underflow to 0 (or the loss does not reach the "
                "parameters): no gradient reached the parameters (guard.stall_steps=20). Try precision=bf16 (float32's range, "
                "no loss scale), a larger loss (a sum, not a mean of tiny terms), or a look at whether the loss depends on the "
                "parameters; guard.on_stall=warn trains on")


def _stall_run(path, grad_norms, *events, scale=65536.0):
    """A 60-step fp16 run directory (intervals of 10) with these grad norms, a constant loss of 7.4e-15, and ``events``."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text("train:\n  max_steps: 60\nguard:\n  stall_steps: 20\n")
    (path / "metrics.jsonl").write_text("".join(json.dumps({"step": 10 * (i + 1), "interval_steps": 10, "loss": 7.4e-15,
                                                            "loss_min": 7.4e-15, "grad_norm": g, "loss_scale": scale}) + "\n"
                                                for i, g in enumerate(grad_norms)))
    append_events(path, *events)
    h = health_summary(load_run(path))
    return h, {text.split(" ", 2)[1] if text.startswith("Train loss") else text[:8]: (level, text) for level, text in h.sentences}


def test_a_stall_the_run_trained_on_through_is_a_problem_said_with_since_when_and_what_to_do(tmp_path):
    """guard.on_stall=warn (a trial: fp16tasks' tiny task): the stall event was in events.jsonl only, the report read
    'healthy' and the loss line 'ok'. Now the stall is one bad sentence: since when, what the guard saw, what to try."""
    h, said = _stall_run(tmp_path / "warn", [0.0] * 6, {"step": 20, "kind": "stall", "reason": STALL_REASON})
    assert h.level == "bad" and h.figures["stall"]["since"] == 1 and h.figures["stall"]["recovered"] is None
    assert said["Stalled "] == ("bad", (
        "Stalled since step 1, and trained on stalled to step 60 (guard.on_stall=warn): at step 20, 0 of the last 20 steps "
        "were skipped and the 20 applied had a zero gradient; the GradScaler's scale is 6.6e+04: in float16 the gradients "
        "underflow to 0 (or the loss does not reach the parameters): no gradient reached the parameters. Try precision=bf16 "
        "(float32's range, no loss scale), a larger loss (a sum, not a mean of tiny terms), or a look at whether the loss "
        "depends on the parameters; guard.on_stall=stop stops such a run at once."))
    assert said["loss"] == ("warn", "Train loss 7.4e-15 → 7.4e-15 (first → last interval); no gradient reached the "
                                    "parameters on any step (stalled, above).")
    assert [t for _, t in h.sentences].index(said["Stalled "][1]) == 1  # right after the run's progress
    # Gradients that came back (the scale recovered) by the last interval: worth a look, not a problem; the loss line ok.
    h, said = _stall_run(tmp_path / "back", [0.0] * 4 + [0.3, 0.2], {"step": 20, "kind": "stall", "reason": STALL_REASON})
    assert h.level == "warn" and said["Stalled "] == ("warn", (
        "Stalled from step 1 (at step 20, 0 of the last 20 steps were skipped and the 20 applied had a zero gradient; the "
        "GradScaler's scale is 6.6e+04: in float16 the gradients underflow to 0 (or the loss does not reach the parameters): "
        "no gradient reached the parameters); gradients reached the parameters again by step 50 (guard.on_stall=warn "
        "trained on)."))
    assert said["loss"][0] == "ok"
    # A non-zero grad norm at a collapsed loss scale (an underflowed remainder) is no recovery.
    h, _ = _stall_run(tmp_path / "remainder", [0.0] * 4 + [3e-6] * 2, {"step": 20, "kind": "stall", "reason": STALL_REASON},
                      scale=3.6e-12)
    assert h.level == "bad" and h.figures["stall"]["recovered"] is None


def test_a_run_the_stall_guard_stopped_is_a_problem_and_its_loss_line_is_not_ok(tmp_path):
    """guard.on_stall=stop (the default) read 'worth a look', with 'Train loss 7.357e-15 → 7.492e-15' an ok line, while
    a run the consecutive-skip guard stopped read 'problems'. A stop for any other reason (a signal) stays a warning."""
    h, said = _stall_run(tmp_path / "stop", [0.0] * 2, {"step": 20, "kind": "stop", "reason": f"stopping: {STALL_REASON}"})
    assert h.level == "bad" and h.figures["stall"]["stopped"] is True
    assert said["Stopped "] == ("bad", f"Stopped at step 20: {STALL_REASON}.")
    assert said["loss"] == ("warn", "Train loss 7.4e-15 → 7.4e-15 (first → last interval); no gradient reached the "
                                    "parameters on any step (stalled, above).")
    assert not any(t.startswith("Stalled") for _, t in h.sentences)  # the stop's sentence says it once
    h, said = _stall_run(tmp_path / "signal", [0.5] * 2, {"step": 20, "kind": "stop", "reason": "stopped by SIGTERM at step 20"})
    assert h.level == "warn" and said["Stopped "] == ("warn", "Stopped at step 20 by SIGTERM.") and said["loss"][0] == "ok"
    assert h.figures["stall"] is None


def test_stall_parts_reads_each_wording_of_the_stall_guard():
    from stabletrain.report.text import stall_parts

    assert stall_parts(STALL_REASON) == {
        "step": 20, "since": 1, "gist": "0 of the last 20 steps were skipped and the 20 applied had a zero gradient; the "
        "GradScaler's scale is 6.6e+04", "what": STALL_REASON.split(": ", 1)[1].split(" (guard.stall_steps")[0],
        "advice": STALL_REASON.split("Try ")[1].removesuffix("; guard.on_stall=warn trains on")}
    collapsed = ("the run is stalled at step 60: 18 of the last 20 steps were skipped and the 2 applied had gradient norms of "
                 "at most 9.5e-06, under 0.001 x the run's earlier 2.6 (they underflowed at the loss scale); the GradScaler's "
                 "scale is 3.6e-12: no gradient reached the parameters measurably (guard.stall_steps=20). Try precision=bf16; "
                 "guard.on_stall=warn trains on")
    parts = stall_parts(f"stopping: {collapsed}")
    assert (parts["step"], parts["since"], parts["advice"]) == (60, 41, "precision=bf16")
    assert parts["gist"].endswith("(they underflowed at the loss scale); the GradScaler's scale is 3.6e-12")
    assert stall_parts("20 consecutive skipped steps (guard.max_consecutive_skips=20) at step 57") is None


def test_a_resume_that_changed_the_global_batch_is_said_in_the_summary(tmp_path):
    """A new-user trial: an FSDP run resumed on 1 process of 2 halved its global batch at step 80; the summary said only
    'Resumed once, at step 80.' (the reshard in the events table alone) beside curves whose level moved there."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("clip:\n  max_norm: 1.0\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": 10 * (i + 1), "loss": 1.0}) + "\n" for i in range(10)))
    (run / "events.jsonl").write_text(json.dumps(
        {"step": 80, "kind": "resume", "reason": "resumed ...", "time": 1.0, "resharded": True, "old_world_size": 2,
         "new_world_size": 1, "old_global_batch": 16, "new_global_batch": 8}) + "\n")
    h = health_summary(load_run(run))
    assert "Resumed once, at step 80." in h.text and h.figures["reshards"] == 1
    assert ("At step 80 the run went on under 1 process (it had 2): the global batch 16 -> 8 samples per step from "
            "there, which moves the loss and grad-norm curves' level there.") in h.text, h.text
    # the snapshot's table lists each resume's launch in rows of its own (its command as one line, as the first's)
    (run / "snapshot.json").write_text(json.dumps({"command": ["stabletrain", "train"], "world_size": 2, "resumes": [
        {"step": 80, "command": ["stabletrain", "train", "--resume", "run"], "world_size": 1}]}))
    page = write_report(run).read_text()
    assert ">resumes.1.world_size<" in page and ">stabletrain train --resume run<" in page, page[page.find('id="snapshot"'):]


def test_compare_says_which_runs_were_resumed_and_where(tmp_path):
    """A new-user trial: comparing a run with one resumed on 1 process of 2 showed 'train.batch_size 8 | 16' and
    'dist.nproc 2 | 1' as if the whole run had trained so; nothing said the second ran 90 steps as the first did."""
    runs = []
    for name, events in (("ref", []), ("resumed", [{"step": 90, "kind": "resume", "reason": "resumed ...", "time": 1.0,
                                                    "resharded": True, "old_world_size": 2, "new_world_size": 1,
                                                    "old_global_batch": 16, "new_global_batch": 16}])):
        run = tmp_path / name
        run.mkdir()
        (run / "config.yaml").write_text(f"train:\n  batch_size: {8 if name == 'ref' else 16}\n")
        (run / "metrics.jsonl").write_text("".join(json.dumps({"step": 10 * (i + 1), "loss": 1.0}) + "\n" for i in range(20)))
        (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        runs.append(run)
    html = write_compare(runs, tmp_path / "cmp.html").read_text()
    row = html[html.find(">resumed at step<"):]
    assert row.find(">—<") < row.find(">90 (1 under another world size)<") < row.find("</tr>"), row[:400]
    assert "resumed was resumed: the config shown is each run's last launch's" in html


def test_spikes_met_again_after_each_of_several_rollbacks_are_all_counted(tmp_path):
    """A new user's trial: 20 spike events over 3 rollbacks read '5 loss spikes at step 66-70; before the rollback, at step
    66-70': the spikes before the rollbacks were counted once per step, and 'the rollback' was one."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("clip:\n  max_norm: 1.0\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": 10 * (i + 1), "loss": 1.0}) + "\n" for i in range(8)))
    events, t = [], 0.0
    for round_ in range(3):
        for step in (66, 67):
            t += 1
            events.append({"step": step, "kind": "spike", "reason": "loss spike", "time": t, "loss": 5.0})
        if round_ < 2:
            t += 1
            events.append({"step": 60, "kind": "rollback", "reason": "rolled back", "time": t, "from_step": 70})
    # (and a later rollback that went back past none of them is not theirs: a review)
    events.append({"step": 75, "kind": "rollback", "reason": "rolled back", "time": t + 1, "from_step": 78})
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    h = health_summary(load_run(run))
    assert ("2 loss spikes at step 66-67; before the 2 rollbacks, at step 66-67 (4 spikes: the run met them again after "
            "each rollback).") in h.text, h.text


def test_an_end_interval_with_a_skipped_nonfinite_step_and_a_spike_is_taken_without_the_spike_over_its_finite_steps(tmp_path):
    """A trial: one interval held a NaN step (skipped, not in its mean: 9 finite steps) and a spike; the end without the
    spike was (mean x 10 - spike) / 9: 'Train loss 144.1 -> 1.702' for a loss of ~5."""
    run = tmp_path / "both"
    run.mkdir()
    (run / "config.yaml").write_text("guard:\n  spike_ratio: 2.0\n")
    for finite, nonfinite in ((9, 1), (10, 1)):  # (10: a step whose grad norm alone was not finite: its loss is in the mean)
        losses = [5.0] * (finite - 1) + [1000.0]  # the interval's finite losses: its mean is theirs
        rows = [(10, 6.0, 5.5, 0, 10), (20, 5.6, 5.2, 0, 10), (30, sum(losses) / finite, 5.0, nonfinite, finite)]
        (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "interval_steps": 10, "loss": m, "loss_min": lo,
                                                               "num_nonfinite": n, "loss_steps": k}) + "\n"
                                                   for s, m, lo, n, k in rows))
        (run / "events.jsonl").write_text(json.dumps({"step": 27, "kind": "spike", "reason": "loss spike", "loss": 1000.0})
                                          + "\n")
        h = health_summary(load_run(run))
        assert h.figures["loss_end"] == pytest.approx(5.0), finite  # (a review: -7.438 from num_nonfinite's count)


def test_an_fp16_run_with_no_step_skipped_says_the_loss_scale_it_held(tmp_path):
    """A new user's trial: an fp16 run's report named the loss scale only where steps were skipped ('No steps skipped.',
    the scale in the plot alone); a bf16 or fp32 run has none to name."""
    import torch
    from helpers import cfg, regression_task

    for precision in ("fp16", "fp32"):
        run = tmp_path / precision
        torch.manual_seed(1)  # (the model's init: at 0 a step's fp16 gradients overflow at the scale of 65,536)
        Trainer(cfg(f"precision={precision}", "train.max_steps=6", "log.every=3", "log.tensorboard=false"),
                task=regression_task(), run_dir=run).fit()
        said = [t for _, t in health_summary(load_run(run)).sentences if t.startswith("No steps skipped")]
        scale = [r["loss_scale"] for r in read_jsonl(run / "metrics.jsonl")[0]]
        assert said == ([f"No steps skipped; the fp16 loss scale held at {scale[-1]:,.6g}."] if precision == "fp16"
                        else ["No steps skipped."]), (said, scale)


def test_the_checkpoint_count_says_how_many_are_kept_on_disk(tmp_path):
    """A trial: 'the report says 4 checkpoints' beside 3 on disk (ckpt.keep pruned step 0's), unsaid."""
    from helpers import cfg, regression_task

    run = tmp_path / "run"
    Trainer(cfg("train.batch_size=8", "train.max_steps=8", "log.every=4", "ckpt.every=2", "ckpt.keep=2",
                "log.tensorboard=false"), task=regression_task(), run_dir=run).fit()
    said = [t for _, t in health_summary(load_run(run)).sentences if "checkpoints, the last" in t]
    assert said == ["5 checkpoints, the last at step 8 (2 kept on disk: ckpt.keep=2)."], said


def test_a_spike_the_models_own_dropout_drew_is_noise_in_the_health_summary_not_a_problem(run_copy):
    """A trial: a clean Hugging Face run (GPT-2's dropout 0.1, nothing planted) had one spike the diagnosis itself called
    the step's dropout draw ('not the samples nor the state'), and its report said 'problems'. Worth a look, said why."""
    (run_copy / "events.jsonl").write_text("")
    spike = {"step": 25, "kind": "incident", "anomaly": "spike", "reason": "loss spike", "path": "incidents/step_000025",
             "diagnosis": {"failure_class": "dropout", "summary": "dropout: with every dropout off the window's loss is "
                           "normal by the guard's rule"}}
    append_events(run_copy, {"step": 25, "kind": "spike", "reason": "loss spike", "loss": 0.06}, spike)
    said = dict((t, level) for level, t in health_summary(load_run(run_copy)).sentences)
    (text,) = [t for t in said if t.startswith("1 incident")]
    assert said[text] == "warn" and "(the model's own dropout draw made it: noise, not a fault)" in text, text
    append_events(run_copy, {**spike, "step": 35, "diagnosis": {"failure_class": "data", "summary": "data: samples 3"}})
    said = dict((t, level) for level, t in health_summary(load_run(run_copy)).sentences)
    assert [level for t, level in said.items() if t.startswith("2 incidents")] == ["bad"]  # (a data spike is one)


@pytest.mark.parametrize("skipped, scale, level, case", [
    ((3,), 32768.0, "ok", ""), ((3, 14, 25, 37), 32768.0, "warn", ""), ((3,), 0.5, "warn", ""),
    ((3,), 32768.0, "warn", "or NaN"),  # a review: a NaN a batch made under fp16 is no routine back-off
    ((3,), 32768.0, "warn", "unnamed"),  # ... nor skips events.jsonl does not name (metrics count 2, one event)
    ((1, 2, 3), 32768.0, "warn", "every"),  # ... nor a run that applied no update
    ((2,), 32768.0, "ok", "every")])  # (3 steps, one overflow: routine; a review found every 3-step run warned)
def test_the_gradscalers_routine_back_off_is_healthy_not_worth_a_look(tmp_path, skipped, scale, level, case):
    """A trial: one fp16 overflow at step 20 of 60 (the GradScaler's routine skip and back-off, which the configuration
    docs call a routine skip event, not an incident) marked the page 'worth a look' with no reason given. A few at a
    scale that recovers are healthy; more, or a scale below the guard's unrecoverable one, are worth a look."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("train:\n  max_steps: 60\nprecision: fp16\n")
    (run_dir / "snapshot.json").write_text(json.dumps({"precision": "fp16"}))
    every, width = (3, 1) if case == "every" else (10, 10)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({
        "step": width * (i + 1), "interval_steps": width, "loss": 2.0 - 0.1 * i, "loss_min": 1.9 - 0.1 * i,
        "grad_norm": 0.5, "loss_scale": scale, "num_skipped": sum(width * i < s <= width * (i + 1) for s in skipped)
        + (case == "unnamed" and i == 0)}) + "\n" for i in range(every if case == "every" else 6)))
    append_events(run_dir, *({"step": s, "kind": "skip", "loss_scale": scale,
                              "reason": f"skipped: fp16 overflow{' or NaN' if case == 'or NaN' else ''} (grad norm "
                                        f"{'nan' if case == 'or NaN' else 'inf'}; GradScaler backs off its scale)"}
                             for s in skipped))
    h = health_summary(load_run(run_dir))
    (said,) = [(lv, text) for lv, text in h.sentences if " skipped" in text and "steps skipped" not in text[:9]]
    assert said[0] == level, said
    assert h.level == level or case == "every"


def test_a_short_last_interval_is_read_with_the_one_before_it_not_as_the_runs_end(tmp_path):
    """A trial (Lightning, max_steps=30, log_every=4): the headline read 'Train loss 0.9883 → 1.239 (first → last
    interval)' from a last interval of 2 steps, beside interval means falling 0.99 → 0.75 and a falling validation loss;
    the compare page repeated 1.239. The tail is read with the interval before it, a mean over both's 6 steps."""
    means = [0.9883, 0.95, 0.87, 0.83, 0.80, 0.88, 0.75, 1.239]
    rows = [{"step": min(4 * (i + 1), 30), "interval_steps": 4 if i < 7 else 2, "loss_steps": 4 if i < 7 else 2, "loss": m,
             "loss_min": 0.9 * m} for i, m in enumerate(means)]
    (tmp_path / "config.yaml").write_text("train:\n  max_steps: 30\n")
    (tmp_path / "snapshot.json").write_text("{}")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    h = health_summary(load_run(tmp_path))
    (level, text), = [(lv, t) for lv, t in h.sentences if t.startswith("Train loss")]
    assert (level, text) == ("ok", "Train loss 0.9883 → 0.913 (first → last interval with the 2-step one after it).")
    assert h.figures["loss_last"] == 1.239 and h.figures["loss_end"] == pytest.approx((0.75 * 4 + 1.239 * 2) / 6)
    # A review: not where the run stopped short (a guard's stop, a crash: its last interval is where it went wrong), nor
    # in a run of 3 intervals; and the rise is judged on the intervals as logged.
    (tmp_path / "events.jsonl").write_text(json.dumps({"step": 30, "kind": "stop", "time": 1.7e9, "reason": "stopping: "
                                                       "the guard's"}) + "\n")
    (tmp_path / "config.yaml").write_text("train:\n  max_steps: 40\n")
    h = health_summary(load_run(tmp_path))
    assert [t for _, t in h.sentences if t.startswith("Train loss")] == ["Train loss 0.9883 → 1.239 (first → last interval)."]
    (tmp_path / "events.jsonl").unlink()
    (tmp_path / "config.yaml").write_text("train:\n  max_steps: 30\n")
    short = rows[:2] + [{**rows[-1], "loss": 6.0, "loss_min": 5.4}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in short))
    (level, text), = [(lv, t) for lv, t in health_summary(load_run(tmp_path)).sentences if t.startswith("Train loss")]
    assert level == "warn" and text.startswith("Train loss 0.9883 → 6 (first → last interval); it rose x6.32"), text
    rows[-1].update(loss=1.6, loss_min=1.5)  # four intervals, the last 2 steps long: merged, the rise judged on the merge
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[4:]))  # (a review: a 2-step tail
    (level, text), = [(lv, t) for lv, t in health_summary(load_run(tmp_path)).sentences if t.startswith("Train loss")]
    assert (level, text) == ("ok", "Train loss 0.8 → 1.033 (first → last interval with the 2-step one after it)."), text
    rows[-1].update(loss=6.0, loss_min=5.4)  # ... at 2.13x the best was 'it rose', beside a headline of the merge)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[4:]))
    (level, text), = [(lv, t) for lv, t in health_summary(load_run(tmp_path)).sentences if t.startswith("Train loss")]
    assert level == "warn" and "; it rose x" in text and "from its best interval's mean, 0.75 at step 28." in text, text
    # A review: a 1-step tail that is the spike itself, excluded from the end, was then the rise (x26.7)
    spiky = rows[4:-1] + [{"step": 29, "interval_steps": 1, "loss_steps": 1, "loss": 20.0, "loss_min": 20.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in spiky))
    (tmp_path / "config.yaml").write_text("train:\n  max_steps: 29\n")
    (tmp_path / "events.jsonl").write_text(json.dumps({"step": 29, "kind": "spike", "time": 1.7e9, "loss": 20.0,
                                                       "reason": "loss spike"}) + "\n")
    (level, text), = [(lv, t) for lv, t in health_summary(load_run(tmp_path)).sentences if t.startswith("Train loss")]
    assert "rose" not in text, text

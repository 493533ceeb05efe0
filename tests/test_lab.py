"""The labs: each runs, checks its observation and passes; run with the setting that breaks it, it fails."""

import html
import os
from pathlib import Path

import pytest
import torch

from stabletrain.cli import main
from stabletrain.lab import LABS, format_result, run_lab
from stabletrain.lab.index import write_index

TESTS = Path(__file__).parent
SLOW = {"1", "4", "6", "7", "8", "accept"}  # more than a few seconds each on 2 CPU cores
_RESULTS = {}


def result_of(key, tmp_path_factory):
    """Run lab ``key`` once per session (plots into a temp dir) and keep the result."""
    if key not in _RESULTS:
        _RESULTS[key] = run_lab(key, tmp_path_factory.mktemp(f"lab{key}"))
    return _RESULTS[key]


def _claims(result):
    return {c.text: c.passed for c in result.claims}


@pytest.mark.parametrize("key", [pytest.param(k, marks=pytest.mark.slow) if k in SLOW else k for k in LABS])
def test_every_lab_runs_and_its_observation_holds(key, tmp_path_factory):
    result = result_of(key, tmp_path_factory)
    failed = [c.text for c in result.claims if not c.passed]
    assert result.passed, f"lab {key} failed: {failed}\n{format_result(result)}"
    assert result.plots and all(p.exists() and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in result.plots)
    assert result.rows and all(len(row) == len(result.columns) for row in result.rows)
    assert len(result.explanation) >= 2
    text = format_result(result)
    assert f"lab {key}: PASS" in text and LABS[key].question in text


def test_lab_is_deterministic_and_its_explanation_follows_the_numbers():
    a, b, other = run_lab("3"), run_lab("3"), run_lab("3", seed=1)
    assert a.rows == b.rows and a.explanation == b.explanation
    assert other.rows != a.rows and other.explanation != a.explanation and other.passed
    # The sentences carry the measured values, not fixed text.
    assert f"{a.numbers['diff_naive']:.3g}" in " ".join(a.explanation)


def test_lab3_plots_its_windows_on_integer_ticks(tmp_path, monkeypatch):
    from stabletrain.lab import lab3, save_figure

    ticks = []

    def spy(fig, path):  # the real save, after reading the x ticks matplotlib chose
        fig.canvas.draw()
        ticks.extend(t for ax in fig.axes for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1])
        return save_figure(fig, path)

    monkeypatch.setattr(lab3, "save_figure", spy)
    run_lab("3", tmp_path)
    assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_lab6_says_its_throughput_is_one_timing_whichever_way_it_went():
    """Four runs gave +366%, +47%, +1062% and -78%: only the negative one was told it was noise."""
    text = " ".join(run_lab("6").explanation)
    if not torch.cuda.is_available():
        assert "Each figure is one timing of 20 steps: on a CPU shared with other work it moves by more than the " \
               "logging costs" in text, text


def test_lab7_plots_every_candidate_those_non_finite_from_their_first_step_too(tmp_path, monkeypatch):
    """The divergence panel showed 2 of its 6 candidates: those non-finite from their first replayed step had no point."""
    from stabletrain.lab import lab7, save_figure

    legends = []

    def spy(fig, path):
        legends.extend([t.get_text() for t in ax.get_legend().get_texts()] for ax in fig.axes)
        return save_figure(fig, path)

    monkeypatch.setattr(lab7, "save_figure", spy)
    result = run_lab("7", tmp_path)
    for labels, record in zip(legends, (result.numbers["divergence"], result.numbers["sqrt"])):
        assert len(labels) == len(record["candidates"]), labels
    assert any("non-finite at step" in label for label in legends[0]), legends[0]
    # its runs are kept under the lab's folder: the incident lines it prints point there (they pointed into a temporary
    # folder removed when the lab ended; a new user's 'stabletrain diagnose' of one found nothing)
    assert sorted(p.name for p in (tmp_path / "lab7-runs").iterdir()) == ["div", "sqrt"]
    assert list((tmp_path / "lab7-runs" / "div" / "incidents").glob("step_*"))


def test_a_labs_runs_folder_is_replaced_each_time_and_temporary_without_an_out_dir(tmp_path):
    from stabletrain.lab import runs_folder

    with runs_folder(tmp_path, "lab9") as where:
        (Path(where) / "run").mkdir()
    with runs_folder(tmp_path, "lab9") as where:  # (a second run of the lab: its runs start afresh, not refused)
        assert Path(where) == tmp_path / "lab9-runs" and not list(Path(where).iterdir())
    with runs_folder(None, "lab9") as where:
        kept = Path(where)
        assert kept.is_dir()
    assert not kept.exists()


# -- each observation can fail: the lab run with the setting that breaks it ---------------------------


@pytest.mark.slow
def test_lab1_fails_when_kaiming_is_swapped_for_normal_init():
    result = run_lab("1", schemes={"Kaiming": ("normal", 1.0)})
    assert not result.passed
    claims = _claims(result)
    assert not next(ok for text, ok in claims.items() if text.startswith("Kaiming with relu"))
    assert next(ok for text, ok in claims.items() if text.startswith("Xavier (gain 1) with relu"))
    assert result.numbers["relu/Kaiming/fwd_drift"] > 1e3


def test_lab1_counts_layers_and_its_xavier_is_the_chapters_gain_1_shrinking_by_1_over_sqrt2(tmp_path, monkeypatch):
    """The chapter's unit is the layer (12 Linear layers), and its Xavier is xavier_uniform_ with gain 1: with ReLU
    the std shrinks by about 1/sqrt(2) per layer, where Kaiming's gain sqrt(2) holds it."""
    import math

    from stabletrain.diagnostics import signal_display
    from stabletrain.lab import lab1

    plotted = []
    real_plot = signal_display.plot_signal
    monkeypatch.setattr(lab1, "plot_signal", lambda reports, *a, **k: plotted.append(reports) or real_plot(reports, *a, **k))
    result = run_lab("1", tmp_path, activations=("relu",))
    n = result.numbers
    per_layer = n["relu/Xavier/fwd_per_layer"]
    assert abs(per_layer - 1 / math.sqrt(2)) < 0.05, per_layer  # measured 0.721
    assert n["relu/Xavier/fwd_drift"] < 0.1 and 0.25 < n["relu/Kaiming/fwd_drift"] < 4
    assert n["relu/Xavier/layers"] == 12 and n["relu/Xavier/flagged"] <= 12 and n["relu/N(0,1)/flagged"] <= 12
    rows = {row[1]: row for row in result.rows}
    gain, w_std = result.columns.index("gain"), result.columns.index("w std")
    assert (rows["Xavier"][gain], rows["Kaiming"][gain]) == ("1", "sqrt(2)")
    assert float(rows["Xavier"][w_std]) == pytest.approx(0.125, rel=0.05)  # sqrt(2 / (64 + 64)): not Kaiming's 0.177
    assert float(rows["Kaiming"][w_std]) == pytest.approx(math.sqrt(2 / 64), rel=0.05)
    assert "layers flagged (of 12)" in result.columns
    (reports,) = plotted  # the plot's x axis: layers 1..12
    assert all([layer.index for layer in r.layers] == list(range(1, 13)) for r in reports)
    assert any(c.text.startswith("Xavier (gain 1) with relu: forward std shrinks by about 1/sqrt(2)") and c.passed
               for c in result.claims)


def test_lab2_fails_without_a_scaler():
    result = run_lab("2", precision="bf16")  # no GradScaler: the x1e6 loss is applied, nothing backs off
    assert not result.passed
    assert result.numbers["skipped"] is False and result.numbers["lr_held"] is False
    assert result.numbers["scale_after"] == result.numbers["scale_before"] == 1.0


def test_lab2_scaler_numbers():
    r = run_lab("2")
    assert r.numbers["scale_after"] == r.numbers["scale_before"] / 2 and r.numbers["grew_at"] == 4 + 3
    assert r.numbers["fallback"] == "fp32" and "addmm" in r.numbers["low_ops"]


def test_lab3_fails_with_dropout():
    result = run_lab("3", dropout=0.3)  # other masks per micro-batch: no longer the same function as the big batch
    assert not result.passed
    assert result.numbers["diff_window"] > result.numbers["tol"]
    assert not next(ok for text, ok in _claims(result).items() if "window normalization matches" in text)


@pytest.mark.slow
def test_lab4_fails_when_the_clip_threshold_is_too_high():
    result = run_lab("4", max_norm=1e6)
    assert not result.passed
    assert result.numbers["sgd_on_clipped"] is False and result.numbers["sgd_clip_shrink"] == pytest.approx(1.0)


def test_lab5_fails_when_there_is_no_fault_to_find():
    result = run_lab("5", eps=1e-6)  # the fix: sqrt never sees 0
    assert not result.passed and not any(c.passed for c in result.claims)
    assert result.numbers["first_nonfinite_grad"] is None and result.numbers["bad_samples"] == []


def test_lab5_names_the_planted_fault():
    n = run_lab("5").numbers
    assert (n["first_nonfinite_grad"], n["module"], n["direction"], n["origin"], n["bad_samples"]) == \
        ("0.weight", "1", "backward", True, [37])
    assert n["autograd_node"] == "SqrtBackward0" and n["anomaly_node"] == "SqrtBackward0"


@pytest.mark.slow
def test_lab6_fails_with_a_per_step_sync():
    result = run_lab("6", per_step_sync=True)  # the task's loss calls .item() every step
    assert not result.passed
    assert len(result.numbers["every20_between"]) == 38  # every step but the two log boundaries


@pytest.mark.slow
def test_lab7_reads_its_verdicts_from_the_replays_and_fails_where_nothing_diverges():
    result = run_lab("7", steps=4)
    div = {c["name"]: c for c in result.numbers["divergence"]["candidates"]}
    incident = result.numbers["divergence"]["step"]  # (37 or 38: where an x13.6-per-step growth reaches inf)
    assert 30 < incident < 42
    # From the incident's own state x0.1 fails at once: the gradient at the incident step is made before any LR.
    assert (div["rollback-lr-x0.1"]["verdict"], div["lr-x0.1"]["failed"]["step"]) == ("cures", incident)
    assert f"x0.1 fails ({div['lr-x0.1']['failed']['why']})" in " ".join(result.explanation)
    calm = run_lab("7", lr=0.5, steps=4)  # a stable LR: no divergence for a lower LR to cure
    assert not calm.passed and calm.numbers["divergence"]["failure_class"] == "none"
    assert "did not diverge" in calm.explanation[0]


@pytest.mark.slow
def test_lab8_measures_the_rise_before_the_spike_and_agrees_with_the_doctors_replay(tmp_path_factory):
    result = result_of("8", tmp_path_factory)
    rare, bad = result.numbers["rare"], result.numbers["mislabelled"]
    trace = {row["step"]: row for row in rare["trace"]}
    assert len(trace) == 80 and trace[74]["spike"] is False and trace[75]["spike"] is True
    # The embedding departs at step 74 (measured x7.4 its median), the head does not (x0.77); the loss spikes at 75.
    assert trace[74]["factors"]["embed"] > 5 and trace[74]["factors"]["head"] < 1.5
    assert rare["warning"]["step"] == 74 and rare["warning"]["layer"] == "embed" and rare["warning"]["lead"] == 1
    # The lab's own per-step ratio of step 75 is the one the diagnosis measured replaying that step from its bundle.
    replayed = {name: value for name, _, value, _ in rare["diagnosis"]["jumps"]["update_ratio"]}
    assert replayed["embed.weight"] == pytest.approx(trace[75]["ratios"]["embed"], rel=1e-5)
    # Before the data spike nothing moved (largest measured: x1.97); at the spike every layer's update jumps.
    before = [f for row in bad["trace"] if 70 <= row["step"] < 75 for f in row["factors"].values()]
    assert max(before) < 2.5 and bad["warning"] is None
    assert min(next(r for r in bad["trace"] if r["step"] == 75)["factors"].values()) > 5
    # The rare token's cure is verified on the replay; skipping its step is not one: the spike returns at step 76.
    by = {c["name"]: c for c in rare["remedies"]["candidates"]}
    assert rare["remedies"]["best"] == "update-clip" and by["update-clip"]["verdict"] == "cures"
    assert by["skip-step"]["failed"]["step"] == 76
    # stabletrain's own precursor, reading every step's update, warns at step 74 naming the embedding, and not before
    # the data spike; at the default log.every=10 (steps 70 and 80 read) it stays silent before either.
    assert [w for w in rare["watched"] if w["step"] >= 70] == [{"step": 74, "layers": ["embed.weight"]}]
    assert not [w for w in bad["watched"] if w["step"] >= 70] and rare["precursors"] == bad["precursors"] == []
    assert "stabletrain's own precursor said so too" in " ".join(result.explanation)
    assert [p.name for p in result.plots] == ["lab8_rare_token.png", "lab8_mislabelled.png", "lab8_remedies.png"]


@pytest.mark.slow
def test_lab8_fails_under_momentum_where_the_rare_token_does_not_spike():
    result = run_lab("8", beta1=0.9)  # Adam's default beta1 damps the rare row's first update to 0.84 lr (8.4 at 0)
    assert not result.passed
    claims = _claims(result)
    assert result.numbers["rare"]["step"] is None and result.numbers["rare"]["warning"] is None
    assert not next(ok for text, ok in claims.items() if text.startswith("stabletrain's own precursor"))
    assert not next(ok for text, ok in claims.items() if text.startswith("the rare token's spike is optimizer-state"))
    # The data spike does not depend on the optimizer: its observations still hold.
    assert next(ok for text, ok in claims.items() if text.startswith("the mislabelled window's spike is data"))
    assert result.numbers["mislabelled"]["diagnosis"]["bad_samples"] == [598, 599]
    assert "momentum damps the surge" in result.explanation[0]


@pytest.mark.slow
def test_accept_fails_on_state_outside_the_checkpoint(monkeypatch):
    # The fresh process must import the test task too.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    result = run_lab("accept", task="broken_tasks:hidden_counter_task")
    assert not result.passed
    assert result.numbers["max_param_diff"] > 0
    assert "state outside the checkpoint" in result.numbers["diverged_component"]


# -- the index page and the command line ---------------------------------------------------------------


def test_index_page_shows_each_lab(tmp_path, tmp_path_factory):
    results = [result_of("3", tmp_path_factory), result_of("5", tmp_path_factory)]
    page = write_index(results, tmp_path).read_text(encoding="utf-8")
    for r in results:
        info = LABS[r.key]
        assert f'id="lab-{r.key}"' in page
        for text in (info.question, info.question_zh, r.setup, *r.explanation, *(c.measured for c in r.claims)):
            assert html.escape(text, quote=True) in page
    assert page.count('src="data:image/png;base64,') == sum(len(r.plots) for r in results)
    assert "http://" not in page and "https://" not in page  # self-contained


def test_cli_lists_runs_one_and_rejects_an_unknown_lab(tmp_path, capsys):
    assert main(["lab"]) == 0
    listing = capsys.readouterr().out
    assert all(f"{k} " in listing for k in LABS)
    assert main(["lab", "--list"]) == 0 and capsys.readouterr().out == listing  # as check --list (it was an error)
    assert main(["lab", "5", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "lab 5: PASS" in out and (tmp_path / "lab5_cost.png").exists()
    assert (tmp_path / ".stabletrain-output").is_file()  # a run's git.dirty does not count the labs' folder
    assert main(["lab", "9"]) == 2
    assert "unknown lab '9'" in capsys.readouterr().err


def test_readme_lists_every_lab():
    lines = (TESTS.parent / "docs" / "labs.md").read_text(encoding="utf-8").splitlines()
    start = lines.index(next(line for line in lines if line.startswith("| lab | exercise |")))
    listed = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        listed.append(line.split("|")[1].strip().strip("`"))
    assert listed == list(LABS)


def test_a_labs_own_model_is_where_its_values_are_made_not_the_console_script():
    """The labs' and built-in tasks' models live in the package: their frames are the code that made a value (lab 7's
    eps-guard named '.venv/bin/stabletrain:8', the console script, as where to keep sqrt's input away from 0)."""
    import os

    import stabletrain
    from stabletrain.diagnostics.stacks import keep_user_entries

    package = os.path.dirname(stabletrain.__file__)
    frames = [("/venv/bin/stabletrain", 8, "<module>"), (os.path.join(package, "cli.py"), 90, "main"),
              (os.path.join(package, "loop.py"), 120, "fit"), (os.path.join(package, "lab", "lab7.py"), 51, "forward"),
              (os.path.join(package, "diagnostics", "nonfinite.py"), 200, "__torch_dispatch__")]
    entries = [f'  File "{f}", line {n}, in {fn}\n    code\n' for f, n, fn in frames]
    assert keep_user_entries(entries) == entries[3]


def test_the_labs_folder_stays_out_of_the_users_git_status(tmp_path):
    import subprocess

    from stabletrain.lab import run_lab

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    run_lab("accept", out_dir=tmp_path / "labs")
    status = subprocess.run(["git", "status", "--porcelain"], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert status.stdout == "", status.stdout  # it showed '?? labs/'


def test_each_labs_chinese_line_is_the_chapters_own_words():
    """A student's trial: labs 7 and 8 showed 'chapter questions' that the chapter does not hold (the docs said each lab
    shows the chapter's question in its original Chinese). Each line is now a sentence of the chapter, word for word."""
    from pathlib import Path

    seed = sorted((Path(__file__).resolve().parents[2] / "shared" / "seed").glob("*.txt"))
    if not seed:
        pytest.skip("the course chapter (../shared/seed/) is not beside this checkout")
    chapter = "".join(p.read_text(encoding="utf-8") for p in seed)
    assert [k for k, info in LABS.items() if info.question_zh not in chapter] == []
    assert [k for k, info in LABS.items() if info.quoted] == ["7", "8"]  # said as the chapter's sentence, not a question


@pytest.mark.slow
def test_lab8_watch_runs_console_lines_are_not_shown(capfd, tmp_path):
    """A trial: lab 8's extra log.every=1 runs printed 'loss spike ... at step 75 ...: not captured (capture.incidents=
    false)' between the main runs' lines, which then said the spike was captured. Their lines are not shown."""
    from stabletrain.lab.lab8 import _watch

    capfd.readouterr()
    found = _watch("rare token", 0, 0.03, 0.0, tmp_path / "watch")
    out, err = capfd.readouterr()
    assert found and "stabletrain:" not in out + err, (out, err)

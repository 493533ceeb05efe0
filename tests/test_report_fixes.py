"""Report and compare on what a new user met: the clip verdict's figure and its knob, another tool's folder, the
compare page's config rows, data fingerprints and items-seen axis."""

from __future__ import annotations

import json
import re
import statistics
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn
from torch.utils.data import TensorDataset

from stabletrain import Task, Trainer, load_config
from stabletrain.cli import main
from stabletrain.report import config_diff, health_summary, load_run, write_compare
from stabletrain.report.clip_verdict import CLIP_CUT

pytestmark = pytest.mark.slow  # real training runs


def _clip_run(path: Path, rows: list[tuple[float, float, float, float]], every: int = 10, integration: str | None = None):
    """A run directory holding what the clip verdict reads: (clip_rate, grad_norm, grad_norm_post_clip, grad_norm_max)
    per log interval of ``every`` steps, clip.max_norm=1, AdamW."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.yaml").write_text((f"integration: {integration}\n" if integration else "")
                                      + "clip:\n  max_norm: 1.0\noptim:\n  name: adamw\n")
    (path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": every * (i + 1), "loss": 1.0, "clip_rate": r, "grad_norm": n, "grad_norm_post_clip": p,
                    "grad_norm_max": m}) + "\n" for i, (r, n, p, m) in enumerate(rows)))
    return health_summary(load_run(path))


def _clip_line(h) -> tuple[str, str]:
    return next((level, text) for level, text in h.sentences if "lipping fired on" in text)


# The Monitor run of the issue (tmp/helperV runs/loop): 60 steps, a spike at step 42 (pre-clip mean 308 in 41-50).
LOOP_RUN = [(1.0, 1.7440699, 0.9999994, 2.8198833), (0.9, 1.7759912, 0.9733274, 2.5172219),
            (0.7777778, 1.5520868, 0.9597054, 2.1786022), (0.8, 1.3042784, 0.9402778, 2.1480808),
            (0.8, 308.38449, 0.9661706, 3072.7893), (0.9, 1.4433235, 0.9846529, 2.2265098)]


def test_one_spike_interval_does_not_set_the_clip_cut(tmp_path):
    h = _clip_run(tmp_path / "loop", LOOP_RUN)
    late = LOOP_RUN[3:]  # steps 31-60
    cuts = [1 - post / pre for _, pre, post, _ in late]
    assert [round(c, 3) for c in cuts] == [0.279, 0.997, 0.318]
    ratio_of_sums = 1 - sum(post for _, _, post, _ in late) / sum(pre for _, pre, _, _ in late)
    assert ratio_of_sums > 0.99  # what the page said: "by 99.1% on average"
    assert h.figures["clip_cut_late"] == pytest.approx(statistics.median(cuts)) == pytest.approx(0.3178, abs=1e-4)
    level, text = _clip_line(h)
    assert (level, h.figures["clip_verdict"]) == ("warn", "most")
    assert "83% in the second half, a median cut of 32% to the gradient norm there (over its log intervals): too often" in text
    assert "99" not in text.split("second half")[1].split(":")[0]

    # The same run without the spike: the cut barely moves (it was the spike that made the old figure).
    calm = [*LOOP_RUN[:4], (0.8, 1.40, 0.965, 2.2), LOOP_RUN[5]]
    assert _clip_run(tmp_path / "calm", calm).figures["clip_cut_late"] == pytest.approx(0.3108, abs=1e-3)


@pytest.mark.parametrize("cut, printed, verdict", [(0.195, "19.5%", "trims"), (0.2049, "20%", "frequent"),
                                                   (0.19999, "20.00%", "frequent"), (0.08, "8%", "trims"),
                                                   (0.33, "33%", "frequent")])
def test_the_clip_verdict_follows_the_cut_it_prints(tmp_path, cut, printed, verdict):
    # 30% of the late steps clipped, each interval cut by ``cut`` (the run: 19.50% read "20% ... healthy").
    h = _clip_run(tmp_path, [(0.3, 1.25, 1.25 * (1 - cut), 2.0)] * 10)
    level, text = _clip_line(h)
    assert h.figures["clip_verdict"] == verdict and level == ("ok" if verdict == "trims" else "warn")
    shown = re.search(r"a median cut of ([\d.]+)% to the gradient norm", text)[1]
    assert shown + "%" == printed
    assert (float(shown) >= 100 * CLIP_CUT) == (verdict != "trims")  # the verdict follows the printed figure
    if verdict == "trims":
        assert f"{printed} to the gradient norm there (over its log intervals): healthy" in text
        assert "it would need a look if its median cut of the late gradients reached 20%" in text


# -- Lightning: the advice names the knob the run clipped with --------------------------------------------------------


def _lightning_run(run_dir: Path, *, precision: str, own_clip: float | None = None, trainer_clip: float | None = None):
    L = pytest.importorskip("lightning")
    from stabletrain.integrations.lightning import StableTrainCallback

    class Regressor(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(640, 8, generator=g), 3 * torch.randn(640, 1, generator=g))
    trainer = L.Trainer(max_steps=20, precision=precision, accumulate_grad_batches=2, gradient_clip_val=trainer_clip,
                        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False,
                        callbacks=[StableTrainCallback(run_dir=run_dir, log_every=5, clip_max_norm=own_clip)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Regressor(), torch.utils.data.DataLoader(data, batch_size=16))
    return run_dir


def test_a_lightning_runs_clip_advice_names_the_knob_it_clipped_with(tmp_path):
    # bf16-mixed with a fused optimizer: Lightning cannot clip, the callback refuses gradient_clip_val and clips itself.
    with pytest.raises(ValueError, match=r"pass StableTrainCallback\(clip_max_norm=0.05\)"):
        _lightning_run(tmp_path / "refused", precision="bf16-mixed", trainer_clip=0.05)
    own = load_run(_lightning_run(tmp_path / "own", precision="bf16-mixed", own_clip=0.05))
    assert (own.cfg("integration"), own.cfg("clip.max_norm"), own.cfg("host.gradient_clip_val")) == ("lightning", 0.05, None)
    level, text = _clip_line(health_summary(own))
    assert level == "warn" and "To clip only spikes, set StableTrainCallback(clip_max_norm=) to about " in text
    assert "gradient_clip_val" not in text

    # fp32: the Trainer clips (the callback measures), and that is the knob the advice names.
    host = load_run(_lightning_run(tmp_path / "host", precision="32-true", trainer_clip=0.05))
    assert (host.cfg("clip.max_norm"), host.cfg("host.gradient_clip_val")) == (0.05, 0.05)
    level, text = _clip_line(health_summary(host))
    assert level == "warn" and "To clip only spikes, set Trainer(gradient_clip_val=) to about " in text
    assert "clip_max_norm" not in text


# -- another tool's folder is not a run ---------------------------------------------------------------------------------


def _train(path: Path, *overrides: str, task: Task | None = None) -> Path:
    cfg = load_config(None, ["task=mlp", "train.max_steps=10", "log.every=5", "eval.every=0", "log.progress=false",
                             "log.tensorboard=false", "log.init_signal=false", *overrides])
    Trainer(cfg, task=task, run_dir=path).fit()
    return path


@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory) -> Path:
    return _train(tmp_path_factory.mktemp("fixes") / "mlp")


def _listing(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("files, seen", [
    ({"metrics.jsonl": '{"x":1}\n'},
     """no line of its metrics.jsonl has a 'step' (line 1: {"x":1}), and there is no config.yaml"""),
    ({"config.yaml": "model: {name: resnet50}\nlr: 0.1\n", "metrics.jsonl": '{"epoch":1,"train_loss":2.3}\n'},
     """no line of its metrics.jsonl has a 'step' (line 1: {"epoch":1,"train_loss":2.3}), and its config.yaml holds no """
     "stabletrain key (it holds model, lr)"),
], ids=["metrics-without-steps", "hydra-run"])
def test_report_and_compare_refuse_another_tools_folder_and_write_nothing(mlp_run, tmp_path, capsys, files, seen):
    other = tmp_path / "other"
    other.mkdir()
    for name, text in files.items():
        (other / name).write_text(text)
    before, run_before = _listing(other), _listing(mlp_run)
    assert main(["report", str(other)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"'{other}' is not a stabletrain run directory: {seen}" in err
    for pair in ([str(other), str(mlp_run)], [str(mlp_run), str(other)]):
        assert main(["compare", *pair]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and f"'{other}' is not a stabletrain run directory: {seen}" in err
    assert _listing(other) == before and _listing(mlp_run) == run_before  # nothing written, neither there nor in the run


def test_a_stabletrain_run_that_has_not_logged_yet_is_still_reported(tmp_path):
    run = tmp_path / "fresh"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"task": "mlp", "clip": {"max_norm": 1.0}, "log": {"every": 10}}))
    (run / "metrics.jsonl").write_text("")
    assert main(["report", str(run)]) == 0 and (run / "report.html").is_file()
    assert "No metrics logged yet" in (run / "report.html").read_text(encoding="utf-8")


# -- the compare page ----------------------------------------------------------------------------------------------------


def plain_task() -> Task:
    """A user's factory with no arguments (``task_args: {}``) and no data fingerprint."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 4, generator=g)
    return Task(model=nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)),
                train_data=TensorDataset(x, x.sum(1, keepdim=True)), loss=lambda m, b: F.mse_loss(m(b[0]), b[1]),
                name="plain")


def test_compare_drops_empty_keys_says_why_a_fingerprint_is_missing_and_plots_a_common_unit(mlp_run, tmp_path,
                                                                                              monkeypatch):
    from stabletrain.report import plots

    gpt = _train(tmp_path / "gpt", "task=gpt", "task_args.n_layer=1", "task_args.n_head=2", "task_args.n_embd=16",
                 "task_args.seq_len=32", "task_args.max_bytes=200000", "train.batch_size=8", "eval.every=0")
    mine = _train(tmp_path / "mine", "task=test_report_fixes:plain_task", "train.batch_size=8", task=plain_task())
    runs = [load_run(r) for r in (gpt, mlp_run, mine)]
    assert [r.count_unit for r in runs] == ["tokens", "samples", "samples"]
    assert runs[2].config["task_args"] == {} and runs[2].snapshot["data_fingerprint"] is None

    # task_args: {} beside the others' task_args.*: no row of its own; the task_args.* rows stay.
    diff = dict(config_diff([r.config for r in runs]))
    assert "task_args" not in diff and diff["task_args.n_layer"][0] == 1 and "task_args.width" in diff
    assert config_diff([{"a": {}}, {}, {"a": []}]) == []

    drawn = []
    monkeypatch.setattr(plots, "_png", lambda fig: drawn.append(fig) or b"")
    page = write_compare([gpt, mlp_run, mine], tmp_path / "c.html").read_text(encoding="utf-8")
    assert '<td class="key">task_args</td>' not in page and '<td class="key">task_args.n_layer</td>' in page
    fingerprints = re.search(r'<td class="key">data_fingerprint</td>(.*?)</tr>', page)[1]
    assert fingerprints.count('<td class="val">') == 3 and fingerprints.endswith('<span class="empty">not recorded</span></td>')
    assert "null" not in fingerprints
    assert ("data_fingerprint is not recorded for <b>mine</b>, whose task, test_report_fixes:plain_task, declares no "
            "Task.data_fingerprint: whether it read the same data as the others is unknown.") in page
    assert ("Right: by samples seen. The runs&#x27; losses count different items (tokens for gpt, samples for mlp, mine), "
            "so each run is drawn against the samples it trained on") in page

    # The loss panel by items: every run against its own samples_seen (gpt's tokens would be 32x larger), one axis.
    loss = drawn[0]
    by_step, by_items = loss.axes
    assert by_items.get_xlabel() == "samples seen" and by_items.get_title(loc="left") == "Train loss by samples seen"
    for line, run in zip(by_items.get_lines(), runs):
        assert list(line.get_xdata()) == run.series("loss", "samples_seen")[0]
    assert runs[0].series("loss", "tokens_seen")[0][-1] == 32 * runs[0].series("loss", "samples_seen")[0][-1]
    shown = [p for p in plots.COMPARE_METRICS if any(r.series(p)[0] for r in runs)
             and p not in ("loss_scale", "num_skipped")]  # (no run scales its loss or skipped a step: no such panels)
    throughput = drawn[shown.index("tokens_per_s")]
    assert throughput.axes[1].get_ylabel() == "samples/s"
    assert list(throughput.axes[1].get_lines()[0].get_ydata()) == pytest.approx(runs[0].series("samples_per_s")[1])

    # A run that logs no samples seen: one panel per unit, each run against its own items.
    (mine / "metrics.jsonl").write_text("".join(
        json.dumps({k: v for k, v in json.loads(line).items() if k != "samples_seen"}) + "\n"
        for line in (mine / "metrics.jsonl").read_text().splitlines()))
    drawn.clear()
    page = write_compare([gpt, mine], tmp_path / "d.html").read_text(encoding="utf-8")
    by_step, by_tokens, by_samples = drawn[0].axes
    assert (by_tokens.get_xlabel(), by_samples.get_xlabel()) == ("tokens seen", "samples seen")
    assert len(by_tokens.get_lines()) == len(by_samples.get_lines()) == 1
    assert "Right: one panel per item the runs&#x27; losses count (tokens for gpt, samples for mine)" in page


def test_a_stop_after_a_death_with_no_record_is_after_its_last_record_and_one_after_a_recorded_crash_is_at_its_step():
    """A trial's restart loop killed while fetching step 76 read 'Stopped at step 70' (its last record): a launcher's stop
    after a process died with no record of why says 'after'; a review: one after a crash the rank recorded at its step
    (a refused restart's failure of kind 'crash') is at that step."""
    from stabletrain.report.health import _stop_text
    from stabletrain.report.rundata import Event

    cause = {"exitcode": -9, "signal": "SIGKILL", "rank": 0}
    died = Event(70, "stop", "restart refused: the same failure ended 3 launches in a row", None,
                 {"cause": cause, "failure": {"kind": "exit"}})
    assert _stop_text(died).startswith("Stopped after step 70 (the last step recorded before its process died): restart ")
    crashed = Event(70, "stop", "restart refused: the same failure ended 3 launches in a row", None,
                    {"cause": {**cause, "exitcode": 1, "signal": None}, "failure": {"kind": "crash"}})
    assert _stop_text(crashed).startswith("Stopped at step 70: restart refused"), _stop_text(crashed)
    assert _stop_text(Event(40, "stop", "stopping: max_steps reached", None, {})) == "Stopped at step 40: max_steps reached"

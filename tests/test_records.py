"""The run directory: refuses to overwrite a run, names unknown event kinds (TensorBoard: test_tb_events.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import cfg

from stabletrain.callbacks import Callback
from stabletrain.records.jsonl import read_jsonl
from stabletrain.records.provenance import build_snapshot
from stabletrain.records.rundir import RunDir


def test_run_dir_writes_config_events_and_refuses_an_existing_run(tmp_path):
    run = RunDir(tmp_path / "r")
    run.write_config(cfg("optim.lr=0.01"))
    run.metrics.write({"step": 1, "loss": float("nan")})
    record = run.event(1, "skip", "optimizer step skipped: test", loss_scale=1.0)
    run.close()
    assert record["kind"] == "skip" and "time" in record
    rows, problems = read_jsonl(tmp_path / "r" / "metrics.jsonl")
    assert rows == [{"step": 1, "loss": "nan"}] and not problems  # non-finite floats are JSON strings
    assert "lr: 0.01" in (tmp_path / "r" / "config.yaml").read_text()
    with pytest.raises(FileExistsError, match="already holds a run; resume it with --resume"):
        RunDir(tmp_path / "r")
    RunDir(tmp_path / "r", overwrite=True).close()
    assert not (tmp_path / "r" / "config.yaml").exists(), "overwrite replaced the old run"


def test_an_unknown_event_kind_is_refused_by_name(tmp_path):
    run = RunDir(tmp_path / "r")
    with pytest.raises(ValueError, match="event kind 'explosion' is not one of"):
        run.event(1, "explosion", "boom")
    run.close()


def test_malformed_jsonl_lines_are_problems_with_file_and_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\nnot json\n[1, 2]\n')
    rows, problems = read_jsonl(path)
    assert rows == [{"step": 1}]
    assert problems[0].startswith(f"{path}:2: malformed JSON") and problems[1].startswith(f"{path}:3: expected a JSON object")


def test_a_torn_last_line_is_ended_before_the_next_launch_appends(tmp_path):
    """A launch killed mid-write (or a full disk) left events.jsonl ending inside a line: the next launch's first record
    was glued onto it (a trial: '{"kind": "inter{"kind": "launch", ...'), lost with it, and goodput counted one launch
    fewer. Now the torn line stays one malformed line, and every record after it is read."""
    from stabletrain.records.jsonl import JsonlWriter

    path = tmp_path / "events.jsonl"
    path.write_text('{"step": 1, "kind": "skip"}\n{"step": 2, "kind": "inter')
    writer = JsonlWriter(path)
    with open(path, "a", encoding="utf-8") as other:  # another process appends first (a peer's crash event)
        other.write('{"step": 2, "kind": "crash"}\n')
    writer.write({"step": 3, "kind": "resume"})
    writer.close()
    rows, problems = read_jsonl(path)
    assert [r["step"] for r in rows] == [1, 2, 3] and len(problems) == 1 and problems[0].startswith(f"{path}:2: malformed")
    JsonlWriter(path).close()  # a whole file is left as it is
    assert path.read_text().endswith('"resume"}\n') and not path.read_text().endswith("\n\n")


def test_snapshot_names_versions_device_and_config_hash():
    import torch

    snap = build_snapshot(cfg(), torch.device("cpu"), "fp32", "abc", {"world_size": 1})
    assert snap["versions"]["torch"] == torch.__version__ and snap["device"]["type"] == "cpu"
    assert snap["data_fingerprint"] == "abc" and len(snap["config_hash"]) == 16 and snap["world_size"] == 1
    json.dumps(snap)


def test_a_directory_from_an_attempt_that_never_trained_is_reused_by_the_retry(tmp_path):
    import torch
    from helpers import regression_task

    from stabletrain import Trainer

    task = regression_task()
    inner = task.loss

    def broken(model, batch):
        raise RuntimeError("a bug in the first step")

    task.loss = broken
    with pytest.raises(RuntimeError, match="a bug in the first step"):
        Trainer(cfg("train.max_steps=3"), task=task, run_dir=tmp_path / "r").fit()
    assert (tmp_path / "r" / "checkpoints" / "step_000000").is_dir()  # the step-0 checkpoint, nothing trained
    assert not RunDir.holds_trained_run(tmp_path / "r")
    task.loss = inner
    torch.manual_seed(0)
    Trainer(cfg("train.max_steps=3", "log.every=3"), task=task, run_dir=tmp_path / "r").fit()  # no "already holds a run"
    events = [json.loads(x) for x in (tmp_path / "r" / "events.jsonl").read_text().splitlines()]
    assert "crash" not in {e["kind"] for e in events}, "the failed attempt's record was replaced"
    assert RunDir.holds_trained_run(tmp_path / "r")
    with pytest.raises(FileExistsError):
        RunDir(tmp_path / "r")


def test_a_resume_from_the_step_0_checkpoint_purges_the_steps_a_crash_left_in_tensorboard(tmp_path):
    # The first process logs steps 1-2 and crashes in step 3 before any checkpoint but step 0's (a background
    # save still in flight when a process is killed leaves the same); the resume trains steps 1.. again.
    from helpers import regression_task
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from stabletrain import Trainer

    calls = [0]
    task = regression_task()
    plain_loss = task.loss

    def crashing_loss(model, batch):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("planted crash in step 3")
        return plain_loss(model, batch)

    task.loss = crashing_loss
    # (log.init_signal=false: the step-0 report's calls of the loss would count too)
    c = cfg("log.every=1", "train.max_steps=5", "ckpt.every=100", "eval.every=0", "log.tensorboard=true",
            "log.init_signal=false")
    with pytest.raises(RuntimeError, match="planted crash"):
        Trainer(c, task=task, run_dir=tmp_path / "r").fit()
    task.loss = plain_loss
    Trainer(c, task=task, run_dir=tmp_path / "r", resume=True).fit()
    acc = EventAccumulator(str(tmp_path / "r" / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4, 5]


def test_a_rollback_purges_the_steps_it_trains_again_from_tensorboard(tmp_path):
    """A new user's trial: after 'rolled back from step 40 to step_000020' metrics.jsonl held 10, 20, 30, 40, 50 ...
    while TensorBoard drew 10, 20, 30, 40 (the spike), 30, 40, 50 ...: a rollback purges as a resume does."""
    from spike_tasks import outlier_samples_task
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from stabletrain import Trainer

    c = cfg("train.batch_size=8", "optim.lr=0.01", "log.every=10", "data.shuffle=false", "ckpt.every=10",
            "train.max_steps=40", "guard.on_spike=rollback", "log.tensorboard=true")
    Trainer(c, task=outlier_samples_task(), run_dir=tmp_path / "r").fit()
    events = read_jsonl(tmp_path / "r" / "events.jsonl")[0]
    assert [(e["from_step"], e["to_step"]) for e in events if e["kind"] == "rollback"] == [(20, 10)]
    acc = EventAccumulator(str(tmp_path / "r" / "tb"))
    acc.Reload()
    steps = [r["step"] for r in read_jsonl(tmp_path / "r" / "metrics.jsonl")[0]]
    assert [e.step for e in acc.Scalars("train/loss")] == steps == [10, 20, 30, 40]
    losses = [r["loss"] for r in read_jsonl(tmp_path / "r" / "metrics.jsonl")[0]]
    assert [e.value for e in acc.Scalars("train/loss")] == pytest.approx(losses, rel=1e-6)


def test_git_dirty_does_not_count_stabletrains_own_output(tmp_path, monkeypatch):
    """check's folder, lab output, runs/ and a run directory anywhere are not dirt; the user's changes are."""
    import subprocess

    from stabletrain import Trainer
    from stabletrain.checks import CheckContext
    from stabletrain.records.provenance import OUTPUT_MARKER, git_info, mark_output_dir

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    git("init", "-q")
    (tmp_path / "train.py").write_text("print('train')\n")
    git("add", "train.py")
    git("commit", "-q", "-m", "code")
    monkeypatch.chdir(tmp_path)
    clean = git_info(tmp_path)
    assert clean["dirty"] is False and clean["diff_sha256"] is None

    CheckContext(cfg()).output_path("init_signal.json").write_text("{}")  # stabletrain check's default folder
    mark_output_dir(tmp_path / "labs")  # what run_lab does with --out
    (tmp_path / "labs" / "lab1_signal.png").write_bytes(b"png")
    Trainer(cfg("train.max_steps=2", "log.every=1"), run_dir="runs/a").fit()
    Trainer(cfg("train.max_steps=2", "log.every=1"), run_dir="elsewhere/b").fit()
    assert (tmp_path / "stabletrain-check" / OUTPUT_MARKER).is_file()
    assert git_info(tmp_path)["dirty"] is False
    Trainer(cfg("train.max_steps=2", "log.every=1"), run_dir="runs/c").fit()
    assert json.loads((tmp_path / "runs" / "c" / "snapshot.json").read_text())["git"] == clean  # what compare reads
    (tmp_path / "sub").mkdir()
    assert git_info(tmp_path / "sub")["dirty"] is False  # from a subfolder: paths are the repository's

    (tmp_path / "runs" / "notes.txt").write_text("mine")  # the user's file inside runs/ is the user's
    assert git_info(tmp_path)["dirty"] is True
    (tmp_path / "runs" / "notes.txt").unlink()
    (tmp_path / "new.py").write_text("x = 1\n")
    assert git_info(tmp_path)["dirty"] is True
    (tmp_path / "new.py").unlink()
    (tmp_path / "train.py").write_text("print('changed')\n")
    changed = git_info(tmp_path)
    assert changed["dirty"] is True and changed["diff_sha256"] is not None


def test_a_resume_is_refused_while_processes_of_an_earlier_launch_run_on_the_directory(tmp_path, capsys):
    import subprocess
    import sys

    from stabletrain import Trainer
    from stabletrain.records.launches import LAUNCH_FILE, this_process

    run_dir = tmp_path / "run"

    class SeesTheRecord(Callback):
        def on_step_end(self, state, out):
            seen.append(json.loads((run_dir / LAUNCH_FILE).read_text())["processes"])

    seen = []
    Trainer(cfg("train.max_steps=2"), run_dir=run_dir, callbacks=[SeesTheRecord()]).fit()
    assert seen[0] == [this_process()]  # written while the run runs
    assert not (run_dir / LAUNCH_FILE).exists()  # removed when it ends
    # An earlier launch whose rank is still alive: a real process, recorded as a rank would record itself.
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        recorded = {**this_process(), "pid": rank.pid}
        recorded["start"] = int((Path("/proc") / str(rank.pid) / "stat").read_text().rsplit(")", 1)[1].split()[19])
        (run_dir / LAUNCH_FILE).write_text(json.dumps({"processes": [recorded]}))
        with pytest.raises(ValueError, match=rf"is in use: 1 process\(es\) of an earlier launch still run on it "
                                             rf"\(pid {rank.pid} on .*\); stop them \(kill {rank.pid}\)"):
            Trainer(cfg("train.max_steps=4"), run_dir=run_dir, resume=True)
        # run.resume=auto refuses it before saying it continues the run (a trial: 'continuing it', then the refusal)
        from stabletrain.distributed.group import DistContext
        from stabletrain.services.restarts import begin_launch

        capsys.readouterr()
        with pytest.raises(ValueError, match="is in use"):
            begin_launch(cfg("train.max_steps=4", "run.resume=auto", f"run.dir={run_dir}"), run_dir, False,
                         DistContext.current())
        assert "continuing it" not in "".join(capsys.readouterr())
        # The same pid holding another process (a start time that differs) is not that rank.
        (run_dir / LAUNCH_FILE).write_text(json.dumps({"processes": [{**recorded, "start": recorded["start"] - 1}]}))
        Trainer(cfg("train.max_steps=4"), run_dir=run_dir, resume=True)
        (run_dir / LAUNCH_FILE).write_text(json.dumps({"processes": [recorded]}))
    finally:
        rank.kill()
        rank.wait()
    resumed = Trainer(cfg("train.max_steps=4"), run_dir=run_dir, resume=True)  # the rank is gone: resume goes on
    assert resumed.step == 2
    resumed.fit()
    assert resumed.step == 4 and not (run_dir / LAUNCH_FILE).exists()


def test_stat_fields_read_a_process_state_parent_and_start_and_none_for_a_gone_one():
    from stabletrain.process import stat_fields

    fields = stat_fields(os.getpid())
    assert fields[0] in "RS" and int(fields[1]) == os.getppid() and int(fields[19]) > 0
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: no such pid any more
    assert stat_fields(child.pid) is None


def test_the_optimizer_config_records_what_its_groups_step_with():
    """config.yaml's optim section: AdamW's constructor default weight_decay 0.01 where the HF Trainer's groups hold 0.0
    (a new-user trial), a warm-up schedule's first lr of 0, OneCycleLR's start lr (max_lr / 25): each what the user set."""
    import torch

    from stabletrain.records.provenance import optimizer_config

    m = torch.nn.Linear(2, 2)
    hf = torch.optim.AdamW([{"params": [m.weight], "weight_decay": 0.0}, {"params": [m.bias], "weight_decay": 0.0}], lr=1e-3)
    torch.optim.lr_scheduler.LambdaLR(hf, lambda step: step / 10)  # a warm-up: the groups' lr is 0 now
    assert (optimizer_config(hf)["weight_decay"], optimizer_config(hf)["lr"]) == (0.0, 1e-3)
    split = torch.optim.AdamW([{"params": [m.weight], "weight_decay": 0.1}, {"params": [m.bias], "weight_decay": 0.0}])
    assert optimizer_config(split)["weight_decay"] == [0.1, 0.0]  # decay and no-decay groups: both said
    cycle = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    torch.optim.lr_scheduler.OneCycleLR(cycle, max_lr=1.0, total_steps=10)
    assert optimizer_config(cycle)["lr"] == 1.0 and optimizer_config(cycle)["momentum"] == 0.9  # (the cycle's own aside)


def test_a_hugging_face_batch_counts_the_tokens_its_loss_covers():
    """labels != -100, else the mask, else the ids, else inputs_embeds' (batch, sequence) (a trial's embedded batch of
    4 x 16 counted 4 'tokens', its tokens/s a sixteenth of the truth), else the samples."""
    import torch

    from stabletrain.records.batches import count_tokens

    labels, ids = torch.tensor([[1, 2, -100], [3, -100, -100]]), torch.ones(2, 3, dtype=torch.long)
    assert int(count_tokens({"input_ids": ids, "labels": labels})) == 3
    assert int(count_tokens({"input_ids": ids, "attention_mask": torch.tensor([[1, 1, 0]] * 2)})) == 4
    assert count_tokens({"input_ids": ids}) == 6
    assert count_tokens({"inputs_embeds": torch.randn(4, 16, 8)}) == 64
    assert int(count_tokens({"inputs_embeds": torch.randn(4, 16, 8), "attention_mask": torch.ones(4, 10)})) == 40
    assert count_tokens({"pixel_values": torch.randn(5, 3, 8, 8)}) == 5


@pytest.mark.parametrize("text, want", [
    ('{"world_size": 2}', {"world_size": 2}),
    ('{"world_size": 2, "resumes": [{"world_size": 1}, {"world_size": 4}]}', {"world_size": 4}),
    ('{"resumes": {"world_size": 2}}', {}),  # a hand-edited or foreign snapshot: no launch read, no KeyError traceback
    ('{"resumes": "x"}', {}), ("[1, 2]", {}), ("{not json", {}), (None, {})])
def test_the_last_launch_is_read_from_the_snapshot_or_is_empty_for_one_it_cannot_read(tmp_path, text, want):
    from stabletrain.records.launches import last_launch

    if text is not None:
        (tmp_path / "snapshot.json").write_text(text)
    assert last_launch(tmp_path) == want


def test_a_module_tasks_code_is_its_modules_repository_not_the_working_directorys(tmp_path, monkeypatch):
    """A new user's trial: the same task run from another folder was recorded with that folder's repository (or none):
    compare listed 'git.commit e25eea52b7 | null' as a difference. A `module:function` task's code is its module's."""
    from stabletrain.cli import main

    code = tmp_path / "code"
    code.mkdir()
    (code / "mytask_for_git.py").write_text("from helpers import regression_task\n\ndef make():\n    return regression_task()\n")

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=code, check=True,
                              capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    git("add", "mytask_for_git.py")
    git("commit", "-q", "-m", "task")
    elsewhere = tmp_path / "elsewhere"  # no repository here (tmp_path is none either)
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.syspath_prepend(str(code))
    run_dir = elsewhere / "run"
    assert main(["train", "task=mytask_for_git:make", "train.max_steps=2", "log.progress=false", f"run.dir={run_dir}"]) == 0
    snap = json.loads((run_dir / "snapshot.json").read_text())
    assert snap["git"] == {"commit": git("rev-parse", "HEAD"), "dirty": False, "diff_sha256": None}, snap["git"]
    assert snap["cwd"] == str(elsewhere)
    # an installed package's module (the interpreter's tree: a pyenv checkout's repository is not the run's code), and
    # stabletrain's own (an adapter incident's captured task), are the working directory's
    from stabletrain.records.provenance import code_dir

    assert code_dir("json:loads") == code_dir("stabletrain.records.captured:captured_task") == code_dir("gpt") == elsewhere
    assert code_dir("mytask_for_git:make") == code.resolve()

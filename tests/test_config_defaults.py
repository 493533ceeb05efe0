"""Config keys a new user met: a ``task_args`` key set to its factory's default on resume (the same config as one that
leaves it out), and ``run.dir`` naming a file (one line naming the key and the path, not the OS's [Errno 17])."""

import pytest
import torch
from helpers import cfg
from multiproc import FAST, events

import stabletrain
from stabletrain import Trainer
from stabletrain.cli import main
from stabletrain.config import ABSENT, ConfigDiff, ConfigError, diff_configs
from stabletrain.tasks import task_defaults

SMALL = ["task=mlp", "task_args.num_samples=64", "train.batch_size=16", "eval.every=0", *FAST]


def test_a_task_args_key_at_its_default_is_no_difference_and_another_value_is():
    saved = {"task": "mlp", "task_args": {}}
    assert diff_configs(saved, {"task": "mlp", "task_args": {"width": 128}}) == []
    assert diff_configs(saved, {"task": "mlp", "task_args": {"width": 256}}) == [ConfigDiff("task_args.width", 128, 256)]
    assert diff_configs({"task": "mlp", "task_args": {"activation": "relu", "dropout": 0.0}}, saved) == []
    # a user's factory: its signature's defaults (helpers:slow_mlp_task(sleep=0.02, **kwargs))
    assert diff_configs({"task": "helpers:slow_mlp_task"}, {"task": "helpers:slow_mlp_task", "task_args": {"sleep": 0.02}}) == []
    assert task_defaults("helpers:slow_mlp_task") == {"sleep": 0.02}
    # a factory whose signature cannot be read: compared as given, as before
    assert task_defaults("no_such_module_here:make_task") is None
    assert diff_configs({"task": "no_such_module_here:make_task"},
                        {"task": "no_such_module_here:make_task", "task_args": {"width": 128}}) == [
        ConfigDiff("task_args.width", ABSENT, 128)]


def test_a_resume_with_a_task_args_key_set_to_its_default_goes_through(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", *SMALL, "train.max_steps=2", f"run.dir={run_dir}"]) == 0
    assert main(["train", *SMALL, "train.max_steps=4", "run.resume=auto", f"run.dir={run_dir}", "task_args.width=128"]) == 0
    assert [e["step"] for e in events(run_dir) if e["kind"] == "resume"] == [2]
    capsys.readouterr()
    assert main(["train", *SMALL, "train.max_steps=6", "run.resume=auto", f"run.dir={run_dir}", "task_args.width=64"]) == 2
    err = capsys.readouterr().err
    assert "1 config key differs from the checkpoint's (task_args.width: checkpoint 128, now 64)" in err, err


@pytest.mark.parametrize("under", [False, True], ids=["a file", "under a file"])
def test_run_dir_naming_a_file_is_one_line_naming_the_key_and_the_path(tmp_path, capsys, under):
    file = tmp_path / "a.txt"
    file.write_text("keep me\n")
    run_dir = file / "run" if under else file
    where = f"lies under {str(file)!r}, which is a file" if under else "is a file"
    said = f"config key 'run.dir': {str(run_dir)!r} {where}, not a folder"
    assert main(["train", *SMALL, "train.max_steps=2", f"run.dir={run_dir}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"stabletrain: error: {said}") and len(err.splitlines()) == 1, err
    with pytest.raises(ConfigError, match=f"^{said}") as caught:
        Trainer(cfg("train.max_steps=2", f"run.dir={run_dir}"))
    assert caught.value.key == "run.dir"
    model = torch.nn.Linear(4, 1)
    with pytest.raises(ValueError, match=f"^run_dir={str(run_dir)!r}: {where}, not a folder"):
        stabletrain.Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1), run_dir=run_dir)
    assert file.read_text() == "keep me\n"


def test_resuming_another_tools_run_directory_names_its_config_file(tmp_path, capsys):
    """`train --resume hydrarun` said only "unknown config key 'model'", where --config names the file."""
    from stabletrain.cli import main

    (tmp_path / "config.yaml").write_text("model: {name: resnet50}\nlr: 0.1\nepochs: 90\n")
    assert main(["train", "--resume", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"stabletrain: error: config file {str(tmp_path / 'config.yaml')!r}: unknown config key 'model'"), err


def test_task_defaults_survive_a_module_that_exits_and_compare_imports_no_user_module(tmp_path, monkeypatch):
    """A task module that parses sys.argv at import raised SystemExit out of compare; compare ran the user's code."""
    import sys

    from stabletrain.config.diff import with_task_defaults
    from stabletrain.tasks import task_defaults

    (tmp_path / "exits_at_import.py").write_text("import sys\nsys.exit(2)\ndef make(width=4):\n    pass\n")
    (tmp_path / "plain_task.py").write_text("def make(width=4):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert task_defaults("exits_at_import:make") is None
    config = {"task": "plain_task:make", "task_args": {}}
    assert with_task_defaults(config, imports=False) == config and "plain_task" not in sys.modules
    assert with_task_defaults(config)["task_args"] == {"width": 4}
    assert with_task_defaults({"task": "mlp", "task_args": {}}, imports=False)["task_args"]["width"] == 128

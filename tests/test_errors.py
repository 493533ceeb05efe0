"""Errors in the user's own code: which part of the task raised, the user's frames, and what stays one line.

The tasks with planted mistakes are in ``user_code_tasks.py``; the line numbers below are read from it,
so a test fails if the location shown is not the line that raised.
"""

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from helpers import cfg, regression_task

from stabletrain import Trainer
from stabletrain.errors import batch_note, defined_at, format_task_error, raised_by_stabletrain, task_part, user_location

pytestmark = pytest.mark.slow  # most tests start the CLI in a fresh process

TESTS = Path(__file__).parent
TASKS = TESTS / "user_code_tasks.py"


def line_of(text: str) -> int:
    """The 1-based line of user_code_tasks.py holding ``text`` (exactly one)."""
    hits = [i for i, line in enumerate(TASKS.read_text().splitlines(), 1) if text in line]
    assert len(hits) == 1, (text, hits)
    return hits[0]


def frames_in(text: str) -> list[str]:
    """The files of the ``File "...", line N`` frames a traceback text shows (never a test of the checkout's path:
    a clone's folder is named ``stabletrain``, so the user's own files may sit under ``.../stabletrain/``)."""
    return re.findall(r'^\s*File "([^"]+)", line \d+', text, flags=re.M)


def error_of(name: str, *overrides: str) -> Exception:
    """Train ``user_code_tasks:name`` for two steps without a run directory; return what it raised."""
    with pytest.raises(Exception) as info:  # any type: the user's code decides it
        Trainer(cfg("train.max_steps=2", *overrides, task=f"user_code_tasks:{name}")).fit()
    return info.value


@pytest.mark.parametrize("name, part, error, line", [
    ("unpack_loss_task", "loss", ValueError, "x, y, w = batch"),
    ("bad_forward_task", "model forward", RuntimeError, "x.view(-1, 3)"),
    ("bad_item_task", "dataset item", ValueError, 'float(self.words[i])'),
    ("bad_collate_task", "collate", TypeError, "torch.stack(words)"),
    ("bad_factory_task", "factory", KeyError, 'sizes["large"]'),
    ("bad_val_item_task", "dataset item (validation)", ValueError, 'float(self.words[i])'),
    ("eval_only_loss_task", "loss (validation)", KeyError, "not computed yet"),
])
def test_the_part_of_the_task_that_raised_and_its_line(name, part, error, line):
    err = error_of(name)
    assert type(err) is error
    assert task_part(err) == part
    assert user_location(err).startswith(f"{TASKS}:{line_of(line)} in ")
    text = format_task_error(err, part)
    expected, head = f"the task's {part} raised {error.__name__} at {user_location(err)}", text.splitlines()[0]
    # (and the step whose work raised it, where a step did: not the factory's, before the first)
    assert head == expected if part == "factory" else re.fullmatch(re.escape(expected) + r", in step [12]", head), head
    assert f'File "{TASKS}", line {line_of(line)}' in text
    # stabletrain's and torch's frames are trimmed: what is left is the user's files (the tasks, the loss in helpers.py)
    assert set(frames_in(text)) <= {str(TASKS), str(TESTS / "helpers.py")}


def test_strings_reaching_a_torch_module_are_the_model_forward_called_from_the_loss():
    # No user frame inside the model: nn.Linear itself raises on what the user's loss passed it.
    err = error_of("string_data_task", "train.batch_size=8")
    assert type(err) is TypeError and "must be Tensor" in str(err)
    assert task_part(err) == "model forward"
    assert "helpers.py" in user_location(err)  # the loss line that called the model
    # The message names what the batch held (torch's names neither the batch nor strings): the 8 words of the batch.
    lines = format_task_error(err, "model forward").splitlines()
    assert lines[1].startswith("the batch holds values that are not tensors: batch[0] is a tuple of 8 str. ")
    assert batch_note(err, "model forward") == lines[1]


@pytest.mark.parametrize("batch, note", [
    ((["a", "b"], "TENSOR"), "batch[0] is a list of 2 str"),
    ({"text": ("a", "b"), "y": "TENSOR", "n": [1, 2], "m": {"names": ("p", "q")}},
     "batch['text'] is a tuple of 2 str; batch['m']['names'] is a tuple of 2 str"),
    (("TENSOR", "TENSOR", 3), None),  # tensors and numbers: nothing to say (the loss's own TypeError after the model)
    ((["a", 1],), "batch[0][0] is a str"),
])
def test_the_batch_note_lists_the_parts_that_are_not_tensors(batch, note, tmp_path):
    import torch

    def tensors(value):
        if value == "TENSOR":
            return torch.zeros(2, 4)
        if isinstance(value, dict):
            return {k: tensors(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(tensors(v) for v in value)
        return value

    batch = tensors(batch)
    task = regression_task()
    task.loss = lambda model, b: model(b[0] if isinstance(b, (list, tuple)) else b["text"]).sum() + "?"  # TypeError
    task.train_data = [batch]  # one sample, the batch itself: the collate below passes it through
    task.collate = lambda samples: samples[0]
    with pytest.raises(Exception) as info:
        Trainer(cfg("train.max_steps=1", "train.batch_size=1"), task=task).fit()
    err = info.value
    assert type(err) is TypeError and task_part(err) in ("loss", "model forward")
    got = batch_note(err, task_part(err))
    if note is None:
        assert got is None
    else:
        assert got.startswith(f"the batch holds values that are not tensors: {note}. ")


def test_default_collate_failing_on_the_users_samples_is_the_collate_without_user_frames():
    err = error_of("ragged_data_task")
    assert task_part(err) == "collate" and user_location(err) is None
    head = format_task_error(err, "collate").splitlines()[0]
    assert "torch's default_collate" in head and "Task.collate" in head


def test_one_item_of_another_shape_is_named_by_its_dataset_index_not_blamed_on_the_collate():
    """A new user's dataset returned (4, 3) for item 17 and (4,) for the rest: the line said to write a collate."""
    err = error_of("one_odd_item_task", "data.shuffle=false", "train.batch_size=8")
    head = format_task_error(err, task_part(err)).splitlines()[0]
    assert "dataset item 5 is ((4, 3), (1,)) where the batch's other " in head and "fix the item, or pad them" in head, head


def test_stabletrain_own_errors_are_not_the_tasks():
    task = regression_task()
    for p in task.model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters") as info:
        Trainer(cfg(), task=task)
    assert task_part(info.value) is None and raised_by_stabletrain(info.value)
    err = error_of("unpack_loss_task")
    assert not raised_by_stabletrain(err)


def test_a_loss_that_breaks_the_contract_is_one_line_naming_where_the_user_defined_it(tmp_path):
    err = error_of("loss_not_scalar_task")
    assert isinstance(err, ValueError) and raised_by_stabletrain(err) and task_part(err) is None  # stabletrain's word
    # With a run directory the step-0 init report meets it first: not a warning besides the error (it said it twice)
    with warnings.catch_warnings(record=True) as seen, pytest.raises(ValueError, match="returned a tensor of shape"):
        warnings.simplefilter("always")
        Trainer(cfg("train.max_steps=2", task="user_code_tasks:loss_not_scalar_task"), run_dir=tmp_path / "run").fit()
    assert not [w for w in seen if "signal-propagation" in str(w.message)], [str(w.message) for w in seen]
    assert str(err).startswith(f"task loss (defined at {TASKS}:{line_of('no .mean()')} in <lambda>) returned a tensor "
                               "of shape (16, 1); return a scalar mean or a (sum, count) pair")


def test_defined_at_names_the_users_def_through_partials_and_methods_and_never_a_library():
    import functools

    import torch

    def loss(model, batch, scale):
        return scale * model(batch).mean()

    class Loss:
        def __call__(self, model, batch):
            return model(batch).mean()

    here, line = Path(__file__), loss.__code__.co_firstlineno
    assert defined_at(functools.partial(loss, scale=2.0)) == f"{here}:{line} in loss"
    assert defined_at(Loss()) == f"{here}:{Loss.__call__.__code__.co_firstlineno} in __call__"
    assert defined_at(torch.nn.functional.mse_loss) is None and defined_at(torch.nn.MSELoss()) is None


# -- the command line ---------------------------------------------------------------------------


@pytest.fixture
def cli(capsys, monkeypatch):
    """``stabletrain ARGS`` in this process (``cli.main``, what ``python -m stabletrain`` exits with): the same exit code
    and output as ``python -m stabletrain ARGS`` without a new interpreter (torch imported anew: ~3 s)."""
    from stabletrain.cli import main

    def call(*args, cwd=None, env=None):
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
        if cwd is not None:
            monkeypatch.chdir(cwd)
        capsys.readouterr()
        code = main([str(a) for a in args])
        out = capsys.readouterr()
        return subprocess.CompletedProcess(["stabletrain", *args], code, out.out, out.err)
    return call


def test_train_names_the_loss_and_shows_the_users_line(tmp_path, cli):
    res = cli("train", "task=user_code_tasks:unpack_loss_task", "log.progress=false", f"run.dir={tmp_path / 'r'}")
    assert res.returncode == 1, res.stderr
    first = res.stderr.splitlines()[0]
    assert first.startswith("stabletrain: error: the task's loss raised ValueError at ")
    assert first.endswith(" in loss, in step 1"), first  # (which step: it said only in the events)
    assert f'File "{TASKS}", line {line_of("x, y, w = batch")}, in loss' in res.stderr
    assert "ValueError: not enough values to unpack (expected 3, got 2)" in res.stderr
    assert "step.py" not in res.stderr and "loop.py" not in res.stderr  # stabletrain's frames trimmed
    assert f"stabletrain report {tmp_path / 'r'}" in res.stderr  # the crash is recorded there


@pytest.mark.parametrize("task, part", [("string_data_task", "model forward"), ("bad_item_task", "dataset item"),
                                        ("bad_collate_task", "collate")])
def test_train_on_bad_data_names_the_part(task, part, tmp_path, cli):
    res = cli("train", f"task=user_code_tasks:{task}", "log.progress=false", f"run.dir={tmp_path / 'r'}")
    assert res.returncode == 1, res.stderr
    assert res.stderr.startswith(f"stabletrain: error: the task's {part} raised ")
    assert "user_code_tasks.py" in res.stderr or "helpers.py" in res.stderr
    assert "dataloader.py" not in res.stderr and "module.py" not in res.stderr


def test_a_bad_config_key_is_still_one_line_exit_2(cli):
    res = cli("train", "task=user_code_tasks:unpack_loss_task", "optim.lrr=1")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [res.stderr.strip()] and "unknown config key 'optim.lrr'" in res.stderr


@pytest.mark.parametrize("task, line, said", [
    ("loss_detached_task", "the user's bug: .detach()", "returned a tensor that does not require grad (detached, "
                                                        "or not computed from the model's parameters); "),
    ("loss_int_task", "the user's bug: .long()", "returned an int64 tensor; "),
    ("loss_swapped_pair_task", "the count first", "returned a pair whose first element (the sum) is a tensor that does "
                                                  "not require grad while its second requires grad: that looks like "
                                                  "(count, sum); return (sum, count)"),
    ("loss_zero_count_task", "the user's bug: 0", "returned a pair whose count (the second element) is 0; "),
])
def test_a_loss_that_cannot_be_backpropagated_is_one_line_naming_its_definition_exit_2(task, line, said, tmp_path,
                                                                                       cli):
    # Said before autograd's "element 0 of tensors does not require grad" (or, for the count, a later 'op' incident)
    res = cli("train", f"task=user_code_tasks:{task}", "train.max_steps=3", "log.progress=false", f"run.dir={tmp_path / 'r'}")
    assert res.returncode == 2, res.stderr
    # One line, no traceback (the step-0 signal-propagation report, whose backward meets the loss first, leaves it to the
    # step: no warning of its own before it)
    said_lines = res.stderr.strip().splitlines()
    assert len(said_lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert said_lines[0].startswith(f"stabletrain: error: task loss (defined at {TASKS}:{line_of(line)} in <lambda>) {said}")


def test_a_loss_is_checked_for_a_backward_only_where_one_follows_and_grad_is_enabled():
    import torch

    from stabletrain import as_sum_count
    from stabletrain.policies.accumulation import LossContractError

    detached, counted = torch.tensor(0.5), (torch.tensor(2.0), torch.tensor(0.0))
    with pytest.raises(LossContractError, match="returned a tensor that does not require grad"):
        as_sum_count(detached, 4, backward=True)
    with pytest.raises(LossContractError, match="returned an int64 tensor"):
        as_sum_count(torch.tensor(3), 4, backward=True)
    assert [float(x) for x in as_sum_count(detached, 4)] == [2.0, 4.0]  # evaluated only (a validation pass)
    with torch.no_grad():  # a replay: nothing is backpropagated
        assert [float(x) for x in as_sum_count(torch.tensor(3), 4, backward=True)] == [12.0, 4.0]
        with pytest.raises(LossContractError, match=r"count \(the second element\) is -1;"):  # a plain count: always
            as_sum_count((torch.tensor(2.0), -1), 4)
        with pytest.raises(LossContractError, match=r"count \(the second element\) is nan;"):
            as_sum_count((torch.tensor(2.0), float("nan")), 4)
    assert [float(x) for x in as_sum_count(counted, 4)] == [2.0, 0.0]  # a tensor count is not read (a sync)


def test_check_shows_the_users_frames_once(tmp_path, cli):
    res = cli("check", "overfit", "amp", "init", "task=user_code_tasks:unpack_loss_task", cwd=tmp_path)
    assert res.returncode == 1
    assert res.stdout.count("Traceback (your code") == 1 and res.stdout.count("x, y, w = batch") == 1
    assert res.stdout.count("the same error as in the overfit check") == 2
    assert res.stdout.count("the task's loss raised ValueError") == 2  # amp and init
    assert "ValueError in the task's loss at " in res.stdout  # overfit, with the location
    assert set(frames_in(res.stdout)) == {str(TASKS)} and not list(tmp_path.iterdir())  # torch's frames trimmed


def test_diagnose_names_the_part_when_the_replay_raises(tmp_path, cli):
    run_dir = tmp_path / "run"
    c = cfg("train.batch_size=16", "train.max_steps=6", "log.every=3", "capture.diagnose=false", "data.shuffle=false",
            f"run.dir={run_dir}", task="user_code_tasks:loss_raises_when_asked_task")
    Trainer(c, run_dir=run_dir).fit()
    assert (run_dir / "incidents" / "step_000003").is_dir()
    res = cli("diagnose", str(run_dir), env={"STABLETRAIN_TEST_RAISE": "1"})
    assert res.returncode == 1, res.stderr
    assert res.stderr.startswith("stabletrain: error: the task's loss raised ValueError at ")
    assert f'line {line_of("asked to raise")}, in loss' in res.stderr


@pytest.mark.parametrize("name, part, line", [("bad_item_task", "dataset item", 'float(self.words[i])'),
                                              ("bad_collate_task", "collate", "torch.stack(words)")])
def test_a_dataloader_worker_error_is_read_from_the_traceback_torch_puts_in_its_message(name, part, line):
    err = error_of(name, "data.workers=1")
    assert "Original Traceback" in str(err)  # torch re-raises the worker's exception with its traceback as text
    assert task_part(err) == part
    assert user_location(err).startswith(f"{TASKS}:{line_of(line)} in ")
    text = format_task_error(err, part)
    assert "worker.py" not in text and "fetch.py" not in text and "(raised in a DataLoader worker process)" in text


# -- what an error message may show -------------------------------------------------------------


def test_brief_shows_a_tensors_shape_never_its_values():
    import torch

    from stabletrain.errors import brief

    args = {"batches": [(torch.randn(16, 8), torch.randn(16, 1))], "model": None, "lr": torch.tensor(0.5), "n": 3}
    assert brief(args) == ("{'batches': [(Tensor(shape=[16, 8], dtype=torch.float32), Tensor(shape=[16, 1], "
                           "dtype=torch.float32))], 'model': None, 'lr': tensor(0.5000), 'n': 3}")
    assert brief(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())) == "<Sequential>"  # a repr over lines
    long = brief(list(range(1000)))
    assert len(long) == 200 and long.endswith("...") and "\n" not in long


def _monitor_incident(run_dir: Path, model_factory=None) -> Path:
    """The README's Monitor snippet (an nn.Sequential, a loss_fn that is not importable) with a NaN in step 3's batch."""
    import torch

    import stabletrain

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    loader = [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(6)]
    loader[2][0][5, 1] = float("nan")

    def loss_fn(model, batch):  # inside a function: a new process cannot import it
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)

    with stabletrain.Monitor(model, optimizer, run_dir=run_dir, log_every=3, loss_fn=loss_fn,
                             model_factory=model_factory) as monitor:
        for batch in loader:
            monitor.backward(loss_fn(model, batch))
            monitor.step(batch)
    incident = run_dir / "incidents" / "step_000003"
    assert (incident / "diagnosis.json").is_file()
    return incident


def test_diagnose_names_what_cannot_be_rebuilt_prints_no_tensor_and_shows_the_stored_diagnosis(tmp_path, capsys):
    import json

    from stabletrain.cli import main
    from stabletrain.incident_replay import diagnose_incident
    from stabletrain.tasks import TaskError

    incident = _monitor_incident(tmp_path / "loop")
    stored = json.loads((incident / "diagnosis.json").read_text())
    capsys.readouterr()
    # The Python API: one line naming what could not be rebuilt, without the captured batches' numbers.
    with pytest.raises(TaskError) as info:
        diagnose_incident(incident)
    assert "the model cannot be rebuilt in a new process" in str(info.value)
    assert "tensor(" not in str(info.value) and "\n" not in str(info.value)

    assert main(["diagnose", str(tmp_path / "loop")]) == 0
    out, err = capsys.readouterr()
    assert "tensor(" not in out + err
    assert err.splitlines() == [  # a short line, then one line per obstacle (issue 33: it was one 700-character line)
        f"stabletrain: warning: incident {str(incident)!r} cannot be replayed in a new process; showing diagnosis.json, "
        "written when it was captured. Why not, and what to do:",
        "  - the model is a torch.nn.Sequential, whose layers are not recorded (a model is rebuilt from its class only "
        "when that class builds it with no arguments): pass model_factory='module:function' to stabletrain.Monitor",
        "  - the loss function cannot be imported in a new process (a lambda, or defined in __main__ or inside a "
        "function): pass a loss_fn defined at the top of an importable module"]
    assert out.splitlines()[:2] == [f"incident: {incident} (step 3, rank 0)", f"  {'summary':<30} {stored['summary']}"]
    assert "written to" not in out  # nothing was replayed or written
    # diagnosis.json's first_nonfinite_param names the parameter whose *gradient* went non-finite first: said so
    assert stored["first_nonfinite_param"] == "0.weight" and f"  {'first non-finite gradient':<30} 0.weight\n" in out
    assert main(["diagnose", "--json", str(incident)]) == 0
    assert json.loads(capsys.readouterr().out) == stored
    # remedy names both obstacles too (a trial: it named the model's alone; fixing that met the loss's next)
    assert main(["remedy", str(incident)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"stabletrain: error: incident {str(incident)!r} cannot be replayed in a new process, so no "
                             "remedy can be tried on it") and err[0].endswith("Why not, and what to do:"), err
    assert [line[:40] for line in err[1:]] == ["  - the model is a torch.nn.Sequential, ",
                                               "  - the loss function cannot be imported"]
    assert main(["remedy", "--only", "typo", str(incident)]) == 2  # (a review: an option's error is its own, not that)
    assert "--only: unknown candidate typo" in capsys.readouterr().err


def test_a_model_factory_a_new_process_cannot_import_is_named_as_given_not_as_none_given(tmp_path):
    """model_factory=make_model, a function of the user's script (or, here, of a function): 'the adapter recorded no
    way to build it ... pass model_factory=' told someone who had passed one."""
    from stabletrain.commands.diagnose import replay_obstacles

    def make_model():
        return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    import torch

    incident = _monitor_incident(tmp_path / "loop", model_factory=make_model)
    assert replay_obstacles(incident)[0] == (
        "the model_factory given, test_a_model_factory_a_new_process_cannot_import_is_named_as_given_not_as_none_given."
        "<locals>.make_model, is defined inside a function (a lambda or a closure): a new process cannot import it; "
        "define it in a module and pass it, or 'module:function'")


# -- importing the task's module ----------------------------------------------------------------


def test_a_syntax_error_in_the_task_module_is_shown_with_its_line_and_caret(tmp_path, monkeypatch, capsys):
    from stabletrain.cli import main

    module = tmp_path / "st_syntax_error_task.py"
    module.write_text("import torch\n\n\ndef make_task():\n    return torch.nn.Linear(2, 2) +\n")
    with pytest.raises(SyntaxError) as info:
        compile(module.read_text(), str(module), "exec")
    where = f"{module}:{info.value.lineno}:{info.value.offset}"
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["train", "task=st_syntax_error_task:make_task", "log.progress=false", f"run.dir={tmp_path / 'r'}"]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == f"stabletrain: error: the task module raised SyntaxError at {where}"
    assert lines[1:3] == [f'  File "{module}", line 5', "    return torch.nn.Linear(2, 2) +"]
    assert lines[3].strip() == "^" and lines[-1] == "SyntaxError: invalid syntax" and len(lines) == 5


def test_a_task_module_that_imports_a_missing_package_says_which_import_and_where(tmp_path, monkeypatch, capsys):
    from stabletrain.cli import main

    module = tmp_path / "st_missing_import_task.py"
    module.write_text("import torch\nimport st_no_such_package_here\n\n\ndef make_task():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["train", "task=st_missing_import_task:make_task", f"run.dir={tmp_path / 'r'}"]) == 2
    assert capsys.readouterr().err == (
        "stabletrain: error: config key 'task': module 'st_missing_import_task' (from 'st_missing_import_task:make_task') "
        f"was found, but its import at {module}:2 in <module> failed: No module named 'st_no_such_package_here'; install "
        f"that package in this environment ({sys.executable}) or fix the import\n")


@pytest.mark.parametrize("host, hint", [("monitor", "model_factory="), ("lightning", "save_hyperparameters()"),
                                        ("transformers", "built from its config")])
def test_a_model_that_cannot_be_rebuilt_is_told_what_its_own_host_needs(host, hint):
    from stabletrain.records.captured import model_from_recipe
    from stabletrain.tasks import TaskError

    with pytest.raises(TaskError, match=hint) as err:
        model_from_recipe(None, host)
    assert ("model_factory" in str(err.value)) == (host == "monitor")


def test_a_model_class_of_the_script_run_is_named_so_not_asked_to_move_to_module_level():
    """A LightningModule defined at the top of `python train.py` (module level, save_hyperparameters called): remedy
    said 'define the LightningModule at module level and call self.save_hyperparameters()', which it already did; it
    lives in __main__, which a new process cannot import."""
    from torch import nn

    from stabletrain.records.captured import model_from_recipe, model_recipe
    from stabletrain.tasks import TaskError

    script = type("LitModel", (nn.Linear,), {"__module__": "__main__"})
    recipe = model_recipe(script(2, 2), "lightning")
    assert recipe == {"kind": "none", "why": "the model's class, LitModel, is defined in __main__ (the script you ran): a "
                      "new process cannot import it; move it into a module and import it from there"}
    with pytest.raises(TaskError, match=r"cannot be rebuilt in a new process: the model's class, LitModel, is defined in "
                                        r"__main__ \(the script you ran\)"):
        model_from_recipe(recipe, "lightning")

    class Local(nn.Linear):
        pass

    assert "is defined inside a function: a new process cannot import it; move it into a module and import it from " \
        "there, or pass model_factory='module:function'" in model_recipe(Local(2, 2), "monitor")["why"]


def test_library_frames_installed_outside_this_environment_are_not_the_users(monkeypatch):
    # .ci/run's venv sees torch through a .pth file (the outer environment's site-packages), a venv made with
    # --system-site-packages sees the system's: torch's DataLoader frames there were taken for the user's code, and a
    # dataset item's error was blamed on "task code" (3 cases of test_the_part_of_the_task_that_raised_and_its_line).
    import torch

    from stabletrain import errors

    fetch = os.path.join(os.path.dirname(torch.__file__), "utils", "data", "_utils", "fetch.py")
    monkeypatch.setattr(errors, "_LIBS", ())  # torch where sysconfig does not look
    assert not errors._is_user(fetch) and errors._is_user(str(TASKS))
    monkeypatch.setattr(sys, "path", [*sys.path, "/opt/py/lib/python3.11/site-packages", "/usr/lib/python3/dist-packages"])
    assert {"/opt/py/lib/python3.11/site-packages/", "/usr/lib/python3/dist-packages/"} <= set(errors._library_dirs())


def test_check_on_a_task_that_breaks_its_contract_is_one_line_exit_2_as_train(tmp_path, cli):
    """It failed all 8 checks with the same stabletrain-internal traceback each (rc 1)."""
    res = cli("check", "task=broken_tasks:iterable_data_task", cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.strip().splitlines() == [
        "stabletrain: error: task 'broken_tasks:iterable_data_task': Task.train_data must be a map-style Dataset "
        "(__len__ and __getitem__), got Stream"], res.stderr


@pytest.mark.parametrize("task, said", [
    ("user_code_tasks:loss_not_scalar_task", "task loss (defined at "),
    ("broken_tasks:meta_device_task", "task 'broken_tasks:meta_device_task': the model has 2 parameter(s) or buffer(s) on "
                                      "the meta device ('weight', 'bias'), which hold no values to train: materialize"),
    ("broken_tasks:frozen_model_task", "task 'broken_tasks:frozen_model_task': the model has no trainable parameters")])
def test_check_and_train_refuse_a_broken_loss_or_a_model_with_nothing_to_train_in_one_line(tmp_path, cli, task, said):
    """A new user's trial: `check` failed all 8 checks, each with the same LossContractError (or torch's 'optimizer got
    an empty parameter list') and stabletrain's frames, exit 1, where train said one line, exit 2; a model on the meta
    device crashed train with torch's 'Cannot copy out of meta tensor'. One line, exit 2, in both."""
    for args in (["check"], ["train", "train.max_steps=2", f"run.dir={tmp_path / 'run'}", "log.progress=false"]):
        res = cli(*args, f"task={task}", cwd=tmp_path)
        assert res.returncode == 2 and "FAIL" not in res.stdout, res.stdout + res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"stabletrain: error: {said}"), res.stderr


def test_a_check_name_that_is_none_is_said_before_the_task_is_built(tmp_path, cli):
    """The task's module is imported (it may register checks of its own), its factory not called: a typo is said
    even where the factory raises (a review: the preflight built the task first)."""
    res = cli("check", "overfitt", "task=user_code_tasks:bad_factory_task", cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.startswith("stabletrain: error: unknown check 'overfitt'"), res.stderr


def test_check_on_a_device_this_machine_lacks_is_one_line_not_every_checks_failure(tmp_path, cli):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    res = cli("check", "overfit", "task=mlp", "device=cuda", cwd=tmp_path)
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        "stabletrain: error: config key 'device': 'cuda' asked for, but CUDA is not available on this machine; use "
        "device=cpu or auto"], res.stdout + res.stderr


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield from ((torch.randn(4), torch.randn(1)) for _ in range(8))


@pytest.mark.parametrize("change, said", [
    ({"train_data": _Stream()}, "Task.train_data must be a map-style Dataset (__len__ and __getitem__), got _Stream"),
    ({"train_data": []}, "Task.train_data is empty"),
    ({"loss": None}, "Task.loss must be callable as loss(model, batch), got NoneType"),
    ({"model": "not a model"}, "Task.model is str, expected a torch.nn.Module"),
    ({"count_unit": "tokenz"}, "Task.count_unit must be 'tokens' or 'samples', got 'tokenz'"),  # (a trial: 'items/s')
    ({"name": 5}, "Task.name must be a string, got int 5"),
    ({"collate": "default"}, "Task.collate must be callable or None, got str"),
])
def test_a_task_object_given_to_the_trainer_is_held_to_the_contract_a_factorys_is(change, said):
    """Trainer(cfg, task=obj) checks what resolve_task checks (it skipped them: a raw TypeError from the loop)."""
    import dataclasses

    from stabletrain.tasks import TaskError

    task = dataclasses.replace(regression_task(), **change)
    with pytest.raises(TaskError) as err:
        Trainer(cfg("train.max_steps=2"), task=task)
    assert str(err.value) == f"Trainer(task=...): {said}"
    with pytest.raises(TaskError, match=r"^Trainer\(task=\.\.\.\): expected a stabletrain.Task, got dict$"):
        Trainer(cfg("train.max_steps=2"), task={"model": None})


def test_a_second_fit_of_the_same_trainer_is_one_clear_error_not_an_empty_record(tmp_path):
    trainer = Trainer(cfg("train.max_steps=2", "log.every=1"), task=regression_task(), run_dir=tmp_path / "run")
    assert trainer.fit()["step"] == 2
    with pytest.raises(RuntimeError, match=r"already ran its fit \(to step 2, its run closed\); to train on, resume "
                                           r"its run directory in a new Trainer\(cfg, run_dir=\.\.\., resume=True\)"):
        trainer.fit()
    assert trainer.step == 2


def test_a_crash_is_recorded_though_another_exception_cuts_its_recording_short():
    """torch's SIGCHLD handler raises at any bytecode for each DataLoader worker gone: a second worker's landed inside
    the recording of the first one's crash and the run kept no crash event (a CI flake of the killed-worker test).
    RunState.crash records it again; an error raised three times in a row is let through."""
    from types import SimpleNamespace

    from stabletrain.runstate import RunState

    written, interruptions = [], [RuntimeError("DataLoader worker (pid 2) exited unexpectedly")]

    def event(step, kind, reason, **fields):
        if interruptions:
            raise interruptions.pop()
        written.append((step, kind, fields["failed_step"], fields["error"]))

    state = RunState(cfg=None, task=None, module=torch.nn.Linear(1, 1), named_params=[], device="cpu", dist=None,
                     run=SimpleNamespace(event=event))
    state.step = 5
    state.crash(RuntimeError("DataLoader worker (pid 1) is killed by signal: Killed."), "a training step", 6)
    assert written == [(5, "crash", 6, "RuntimeError")]
    interruptions.extend(RuntimeError("again") for _ in range(3))
    with pytest.raises(RuntimeError, match="again"):
        state.crash(ValueError("x"), "a training step", 6)

"""Config: YAML + dotted overrides, every default written out, errors naming the dotted key and value."""

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

import stabletrain
from stabletrain.config import (
    RESUME_SAFE_KEYS,
    AccumConfig,
    ClipConfig,
    Config,
    ConfigError,
    OptimConfig,
    RunConfig,
    TrainConfig,
    config_from_dict,
    config_to_dict,
    describe_keys,
    diff_configs,
    flatten_config,
    format_config_diff,
    load_config,
    resume_refusal_message,
    resume_safe_text,
)


def test_defaults_and_overrides(tmp_path):
    path = tmp_path / "my.yaml"
    path.write_text("optim:\n  lr: 0.01\naccum:\n  steps: 2\ntask_args:\n  depth: 5\n")
    cfg = load_config(path, ["optim.lr=3e-4", "precision=bf16", "clip.max_norm=null", "task_args.width=8", "task=mlp"])
    assert cfg.optim.lr == 3e-4 and isinstance(cfg.optim.lr, float)
    assert cfg.accum.steps == 2 and cfg.precision == "bf16" and cfg.clip.max_norm is None
    assert cfg.task_args == {"depth": 5, "width": 8}
    assert cfg.train.batch_size == Config().train.batch_size


def test_roundtrip_through_plain_dicts():
    cfg = load_config(None, ["seed=7", "eval.every=0"])
    again = config_from_dict(yaml.safe_load(yaml.safe_dump(config_to_dict(cfg))))
    assert again == cfg


@pytest.mark.parametrize("override, message", [
    ("optim.lrr=1", "unknown config key 'optim.lrr'"),
    ("nope=1", "unknown config key 'nope'"),
    ("optim.lr=fast", "config key 'optim.lr': expected a number, got 'fast'"),
    ("optim.lr=-1", "config key 'optim.lr': expected a number > 0 that float32 holds (at most 3.4e38), got -1.0"),
    ("optim.lr=1e39", "config key 'optim.lr': expected a number > 0 that float32 holds (at most 3.4e38), got 1e+39"),
    ("accum.steps=0", "config key 'accum.steps': expected an integer >= 1, got 0"),
    ("accum.steps=2.5", "config key 'accum.steps': expected an integer, got 2.5"),
    ("precision=fp8", "config key 'precision': expected one of auto, fp32, bf16, fp16, got 'fp8'"),
    ("deterministic=maybe", "config key 'deterministic': expected true or false, got 'maybe'"),
    ("run.resume=yes", "config key 'run.resume': expected one of never, auto, got True (YAML reads yes/no/on/off/true/"
                       "false as a boolean)"),
    ("optim=3", "config key 'optim': expected a mapping, got 3"),
    ("optim.lr.x=3", "config key 'optim.lr': expected a number, got {'x': 3}"),
    ("justakey", "expected dotted key=value"),
])
def test_errors_name_the_key_and_the_value(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read it"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n")
    with pytest.raises(ConfigError, match="expected a mapping at the top"):
        load_config(listy)
    # a section given as a value in the file, and an override of a key under it: it was silently replaced (a trial)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("seed: 1\ntrain: 5\n")
    for overrides in ([], ["train.max_steps=2"]):
        with pytest.raises(ConfigError, match=r"^config file '.*scalar.yaml', line 2: config key 'train': expected a "
                                              r"mapping, got 5$"):
            load_config(scalar, overrides)


def test_every_key_is_described():
    rows = describe_keys()
    keys = [k for k, _, _ in rows]
    for key in ["task", "seed", "deterministic", "precision", "train.max_steps", "train.batch_size", "accum.steps",
                "clip.max_norm", "optim.lr", "optim.weight_decay", "sched.warmup_steps", "log.every", "eval.every", "run.dir"]:
        assert key in keys
    assert all(help_text for _, _, help_text in rows)


def test_a_yaml_file_reads_exponent_numbers_as_floats(tmp_path):
    # PyYAML (YAML 1.1) reads 3e-4 as the string "3e-4"; the command line reads it as a number, so does a file.
    path = tmp_path / "my.yaml"
    path.write_text("optim:\n  lr: 3e-4\n  eps: 1E-6\ntask: pkg.mod:make\ntask_args:\n  scale: -2e3\n  name: 1e\n")
    cfg = load_config(path)
    assert cfg.optim.lr == 3e-4 and isinstance(cfg.optim.lr, float) and cfg.optim.eps == 1e-6
    assert cfg.task_args == {"scale": -2000.0, "name": "1e"}
    assert load_config(None, ["optim.lr=3e-4"]).optim.lr == cfg.optim.lr
    path.write_text("optim:\n  lr: '3e-4'\n")  # quoted: a string, said so
    with pytest.raises(ConfigError, match="config key 'optim.lr': expected a number, got '3e-4'"):
        load_config(path)


def test_a_yaml_syntax_error_names_the_file_line_and_column(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("seed: 1\noptim:\n  lr: [1, 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    message = str(err.value)
    assert message.startswith(f"config file {str(bad)!r}: not valid YAML at line 4, column 1: ")
    assert "\n" not in message
    with pytest.raises(ConfigError, match=r"override 'optim.lr=\[1,': not valid YAML at line 1, column 4"):
        load_config(None, ["optim.lr=[1,"])


def test_an_error_in_a_yaml_file_names_the_file_and_the_line_of_its_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("task: mlp\ntrain:\n  max_steps: 20\n  batch_sz: 4\noptim:\n  lr: 1e-3\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"config file {str(path)!r}, line 4: unknown config key 'train.batch_sz' (known here: ")
    path.write_text("callbacks:\n  - a.b:C\n  - 3\ntask_args:\n  depth: deep\n")
    with pytest.raises(ConfigError, match=rf"^config file {re.escape(repr(str(path)))}, line 3: config key 'callbacks\[1\]': "):
        load_config(path)
    with pytest.raises(ConfigError, match=r"^config file .*, line 5: config key 'task_args.depth': expected an integer"):
        load_config(path, ["callbacks=[]", "task=mlp"])  # a built-in task's task_args, checked with the config
    path.write_text("task: mlp\ntask_args:\n  width: 16\n  widht: 8\n")  # a key the task does not take: its line too
    with pytest.raises(ConfigError, match=r"^config file .*, line 4: unknown config key 'task_args.widht' for task 'mlp'"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"^config key 'callbacks\[0\]': expected a string, got 3$"):
        load_config(path, ["callbacks=[3]"])  # the bad value came from the command line: no file line


def test_a_key_set_twice_in_one_yaml_mapping_is_an_error_naming_both_lines(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("task: mlp\noptim:\n  lr: 1e-3\n  lr: 2e-3\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == (f"config file {str(path)!r}: config key 'optim.lr' is set twice, on lines 3 and 4 "
                              "(the last would win); keep one")
    path.write_text("task: mlp\noptim: {lr: 1e-3}\ntask_args:\n  <<: {width: 8, depth: 2}\n  depth: 3\n")
    assert load_config(path).task_args == {"width": 8, "depth": 3}  # a merge key's value is meant to be overridden


def test_null_for_a_nullable_number_is_said_and_python_s_none_is_read_as_null_on_the_command_line(tmp_path):
    assert load_config(None, ["clip.max_norm=none"]).clip.max_norm is None
    assert load_config(None, ["clip.max_norm=None"]).clip.max_norm is None
    assert load_config(None, ["run.dir=none"]).run.dir == "none"  # a key that takes a string: the string
    with pytest.raises(ConfigError, match=r"^config key 'clip.max_norm': expected a number or null, got 'nil' "
                                          r"\(null is written null or ~\)$"):
        load_config(None, ["clip.max_norm=nil"])
    path = tmp_path / "my.yaml"
    path.write_text("clip:\n  max_norm: none\n")  # YAML's nulls are null, ~, Null, NULL: none is a string there
    with pytest.raises(ConfigError, match=r"line 2: config key 'clip.max_norm': expected a number or null, got 'none'"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"config key 'clip.max_norm': expected a number or null, got 'x'"):
        Config(clip=ClipConfig(max_norm="x")).validate()
    with pytest.raises(ConfigError, match=r"config key 'run.dir': expected a string or null, got 3$"):
        Config(run=RunConfig(dir=3)).validate()


@pytest.mark.parametrize("cfg, message", [
    (lambda: Config(accum=AccumConfig(steps=0)), "config key 'accum.steps': expected an integer >= 1, got 0"),
    (lambda: Config(optim=OptimConfig(lr="x")), "config key 'optim.lr': expected a number, got 'x'"),
    (lambda: Config(train=TrainConfig(batch_size=2.5)), "config key 'train.batch_size': expected an integer, got 2.5"),
    (lambda: Config(precision="fp8"), "config key 'precision': expected one of auto, fp32, bf16, fp16, got 'fp8'"),
    (lambda: Config(optim={"lr": 1.0}), "config key 'optim': expected a section (OptimConfig), got {'lr': 1.0}"),
    (lambda: Config(callbacks="mod:Cls"), "config key 'callbacks': expected a list"),
    (lambda: Config(callbacks=["mod:Cls", 3]), "config key 'callbacks[1]': expected a string, got 3"),
])
def test_validate_checks_a_config_built_in_python(cfg, message):
    with pytest.raises(ConfigError) as err:
        cfg().validate()
    assert message in str(err.value)


def test_validate_normalizes_and_returns_the_config():
    cfg = Config(optim=OptimConfig(lr=1), callbacks=("a.b:C",))
    assert cfg.validate() is cfg
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float) and cfg.callbacks == ["a.b:C"]
    assert Config().validate() == Config()


def test_optimizer_keys():
    cfg = load_config(None, ["optim.name=sgd", "optim.lr=20", "optim.momentum=0.9", "optim.nesterov=true"])
    assert (cfg.optim.name, cfg.optim.lr, cfg.optim.momentum, cfg.optim.nesterov) == ("sgd", 20.0, 0.9, True)
    assert load_config(None, []).optim.name == "adamw"
    for overrides, message in [
        (["optim.name=lion"], "config key 'optim.name': expected one of adamw, adam, sgd, got 'lion'"),
        (["optim.name=sgd", "optim.nesterov=true"], "config key 'optim.nesterov': Nesterov momentum needs optim.momentum > 0"),
        (["optim.momentum=0.9"], "config key 'optim.momentum': applies to optim.name=sgd only"),
        (["optim.name=sgd", "optim.momentum=1.5"], "config key 'optim.momentum': expected a number in [0, 1), got 1.5"),
    ]:
        with pytest.raises(ConfigError) as err:
            load_config(None, overrides)
        assert message in str(err.value), overrides


def test_callbacks_key():
    cfg = load_config(None, ["callbacks=[mypkg.cbs:LogGrads, other:Cb]"])
    assert cfg.callbacks == ["mypkg.cbs:LogGrads", "other:Cb"] and Config().callbacks == []
    with pytest.raises(ConfigError, match=r"config key 'callbacks\[0\]': expected 'module:Class'.*got 'LogGrads'"):
        load_config(None, ["callbacks=[LogGrads]"])


# -- flatten, diff and the resume-safe keys --------------------------------------------------------


def test_flatten_config():
    flat = flatten_config(Config(task_args={"depth": 3}, callbacks=["a:B"]))
    assert list(flat)[:3] == ["task", "task_args.depth", "seed"]
    assert flat["optim.lr"] == 1e-3 and flat["callbacks"] == ["a:B"] and "train" not in flat
    assert flatten_config({"a": {}, "b": {"c": (1, 2)}}) == {"b.c": [1, 2]}  # an empty section has no keys ...
    assert flatten_config({"a": {}, "b": {"c": 1}}, keep_empty=True) == {"a": {}, "b.c": 1}  # ... unless shown
    assert flatten_config({}) == {}


def test_diff_configs_lists_differing_keys_and_ignores_resume_safe_ones():
    saved = load_config(None, ["task=gpt", "task_args.n_layer=2"])
    current = load_config(None, ["task=gpt", "optim.lr=3e-4", "train.max_steps=900", "log.every=5",
                                 "eval.every=7", "run.dir=elsewhere", "task_args.n_head=2", "callbacks=[a:B]"])
    diffs = diff_configs(config_to_dict(saved), current)  # plain dicts and Config objects both work
    # (task_args compare with the gpt factory's defaults filled in: n_layer 4 and n_head 4 where a side leaves them out)
    assert [(d.key, d.saved, d.current) for d in diffs] == [
        ("task_args.n_layer", 2, 4), ("task_args.n_head", 4, 2), ("optim.lr", 1e-3, 3e-4)]
    text = format_config_diff(diffs)
    assert text.splitlines()[0] == "3 config keys differ from the checkpoint's:"
    assert text.splitlines()[3] == "  optim.lr           checkpoint: 0.001  now: 0.0003"
    assert text.splitlines()[2] == "  task_args.n_head   checkpoint: 4  now: 2"
    assert diff_configs(saved, saved) == [] and format_config_diff([]) == ""
    assert diff_configs(saved, current, safe=("optim", "task_args.*", "callbacks")) == [
        ("train.max_steps", 300, 900), ("log.every", 10, 5), ("eval.every", 100, 7), ("run.dir", None, "elsewhere")]
    assert stabletrain.diff_configs is diff_configs


@pytest.mark.slow
def test_help_readme_and_refusal_print_the_same_resume_safe_keys():
    listed = resume_safe_text()
    assert listed == ", ".join(RESUME_SAFE_KEYS) and "train.max_steps" in listed and "callbacks" in listed

    def words(text: str) -> str:
        return " ".join(text.split())  # help and the docs wrap lines

    help_text = subprocess.run([sys.executable, "-m", "stabletrain", "train", "--help"], capture_output=True, text=True,
                               timeout=120, check=True).stdout
    assert f"only these keys may change on resume: {listed}" in words(help_text)
    assert "(on another number of processes, dist.*, also train.batch_size, accum.steps)" in words(help_text)  # (reshard)
    readme = (Path(__file__).parents[1] / "docs" / "checkpoints.md").read_text(encoding="utf-8")
    assert f"only these keys may change on resume: {resume_safe_text(code=True)}" in words(readme)
    diffs = diff_configs(Config(), load_config(None, ["optim.lr=0.5", "accum.steps=2"]))
    message = resume_refusal_message("runs/a", diffs)
    assert message.startswith("resume 'runs/a': 2 config keys differ from the checkpoint's "
                              "(accum.steps: checkpoint 1, now 2; optim.lr: checkpoint 0.001, now 0.5); ")
    assert f"only these keys may change on resume: {listed}." in message and "\n" not in message


def test_trackers_are_config_keys_named_in_errors():
    c = load_config(None, ["log.trackers=[tensorboard,mlflow]", "log.wandb.mode=offline"])
    assert c.log.trackers == ["tensorboard", "mlflow"] and c.log.mlflow.experiment == "stabletrain"
    assert load_config(None, []).log.trackers == ["tensorboard"] and c.log.wandb.dir is None
    with pytest.raises(ConfigError,
                       match=r"config key 'log.trackers\[1\]': expected one of tensorboard, mlflow, wandb, got 'comet'"):
        load_config(None, ["log.trackers=[mlflow,comet]"])
    with pytest.raises(ConfigError, match=r"config key 'log.trackers\[1\]': wandb is listed twice"):
        load_config(None, ["log.trackers=[wandb,wandb]"])
    with pytest.raises(ConfigError, match="config key 'log.trackers': expected a list"):
        load_config(None, ["log.trackers=mlflow"])
    with pytest.raises(ConfigError, match="config key 'log.wandb.mode': expected one of offline, online, got 'cloud'"):
        load_config(None, ["log.wandb.mode=cloud"])
    assert not diff_configs(load_config(None, []), c)  # log.* may change on resume: a tracker can be added


def test_every_help_is_one_short_line():
    long = [(key, len(text)) for key, _, text in describe_keys() if len(text) > 110 or "\n" in text]
    assert long == []  # the docs (docs/configuration.md) hold the rest


def test_an_old_key_is_read_at_its_new_place_with_one_line_per_source(tmp_path):
    from stabletrain.config import MOVED_KEYS
    from stabletrain.console import StableTrainWarning

    path = tmp_path / "old.yaml"
    path.write_text("guard:\n  capture: false\n  remedy_fallback: stop\n  spike_ratio: 3.0\nremedy: inc:skip-step\n")
    with pytest.warns(StableTrainWarning) as caught:
        cfg = load_config(path, ["guard.max_remedies=1", "guard.memory_snapshot=false"])
    assert (cfg.capture.incidents, cfg.remedy.fallback, cfg.remedy.apply) == (False, "stop", "inc:skip-step")
    assert (cfg.remedy.max_applied, cfg.capture.memory_snapshot, cfg.guard.spike_ratio) == (1, False, 3.0)
    assert [str(w.message) for w in caught] == [
        f"config file {str(path)!r}: read old config keys at their new places (remedy -> remedy.apply, guard.capture -> "
        "capture.incidents, guard.remedy_fallback -> remedy.fallback); rename them to stop this line",
        "the overrides: read old config keys at their new places (guard.memory_snapshot -> capture.memory_snapshot, "
        "guard.max_remedies -> remedy.max_applied); rename them to stop this line"]
    with pytest.raises(ConfigError, match="config key 'guard.diagnose' moved to 'capture.diagnose', and both are set"):
        load_config(None, ["guard.diagnose=false", "capture.diagnose=true"])
    new = config_to_dict(Config())
    old = {k: v for k, v in new.items() if k not in ("capture", "remedy")}  # a saved config from before the move
    for was, now in MOVED_KEYS.items():  # every old key, written out
        section, key = now.split(".")
        *parent, last = was.split(".")
        (old[parent[0]] if parent else old)[last] = new[section][key]
    assert config_from_dict(old) == Config()  # read back silently (a bundle, a checkpoint's meta)


def test_the_docs_list_every_key_that_moved():
    from stabletrain.config import MOVED_KEYS

    page = (Path(__file__).parents[1] / "docs" / "configuration.md").read_text(encoding="utf-8")
    for was, now in MOVED_KEYS.items():
        assert f"| `{was}`" in page and f"| `{now}` |" in page


def test_an_override_below_a_value_names_the_value_and_the_override():
    with pytest.raises(ConfigError, match=r"config key 'optim.lr' holds a value \(1\), so override 'optim.lr.x=2' cannot"):
        load_config(None, ["optim.lr=1", "optim.lr.x=2"])
    with pytest.raises(ConfigError, match=r"config key 'capture' holds a value \(1\), so the overrides cannot set"):
        load_config(None, ["capture=1", "guard.diagnose=false"])  # the old key's new place is taken by a value
    with pytest.raises(ConfigError, match=r"config key 'train' holds a value \(5\), so override 'train.max_steps=3' cannot"):
        load_config(None, ["train=5", "train.max_steps=3"])


def test_the_config_knows_the_built_in_task_names_without_torch():
    """The config refuses a task that is neither built in nor 'module:function' itself (before torch is imported):
    its list of the built-in names is the tasks'."""
    from stabletrain.config.schema import BUILTIN_TASKS
    from stabletrain.tasks import BUILTIN_TASKS as built

    assert BUILTIN_TASKS == built
    with pytest.raises(ConfigError, match=r"config key 'task': expected a built-in task \(gpt, mlp\) or "
                                          r"'module:function', got 'nope'"):
        load_config(None, ["task=nope"])
    assert load_config(None, ["task=mlp"]).task == "mlp" and load_config(None, ["task=pkg.mod:make"]).task == "pkg.mod:make"


def test_optim_keys_a_task_with_its_own_optimizer_does_not_use_are_said_once(tmp_path):
    """optim.lr=5e-3 was recorded in config.yaml and silently not used: the task built its own optimizer (lr 1e-3)."""
    import torch

    from stabletrain import StableTrainWarning, Trainer
    from stabletrain.tasks import Task

    def task():
        model = torch.nn.Linear(4, 1)
        data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
        return Task(model=model, train_data=data, loss=lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
                    optimizer=lambda named: torch.optim.AdamW([p for _, p in named], lr=1e-3))

    with pytest.warns(StableTrainWarning) as seen:  # (the init signal's probe step builds a copy with the same factory)
        Trainer(load_config(None, ["train.max_steps=2", "optim.lr=0.005", "log.progress=false"]), task=task(),
                run_dir=tmp_path / "run").fit()
    said = [str(w.message) for w in seen if "not used: the task builds" in str(w.message)]
    assert len(said) == 1 and said[0].startswith("config key optim.lr=0.005 not used: the task builds its own optimizer "
                                                 "(Task.optimizer: AdamW, lr 0.001)"), said


def test_a_trainer_without_run_dir_writes_into_the_configs_run_dir_and_with_neither_writes_nothing(tmp_path, monkeypatch):
    """Trainer(cfg) with run.dir set trained and wrote nothing, silently (the CLI wrote there)."""
    from helpers import regression_task

    from stabletrain import Trainer, load_config

    monkeypatch.chdir(tmp_path)
    chosen = tmp_path / "apidir" / "myrun"
    Trainer(load_config(None, ["train.max_steps=4", "log.every=2", "ckpt.every=2", f"run.dir={chosen}"]),
            task=regression_task()).fit()
    assert (chosen / "config.yaml").is_file() and (chosen / "checkpoints" / "LAST_GOOD").is_file()
    other = tmp_path / "given"  # an explicit run_dir wins over run.dir
    Trainer(load_config(None, ["train.max_steps=2", f"run.dir={tmp_path / 'unused'}"]), task=regression_task(),
            run_dir=other).fit()
    assert (other / "config.yaml").is_file() and not (tmp_path / "unused").exists()
    Trainer(load_config(None, ["train.max_steps=2"]), task=regression_task()).fit()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["apidir", "given"]  # neither: nothing written


def test_an_fsdp_only_key_given_under_ddp_is_said_to_have_no_effect(tmp_path):
    """dist.checkpoint=sharded with dist.strategy=ddp was accepted without a word (its help says 'fsdp only')."""
    import warnings

    from stabletrain import load_config

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        load_config(None, ["dist.checkpoint=sharded", "dist.reshard_after_forward=false"])
        load_config(None, ["dist.checkpoint=sharded", "dist.strategy=fsdp"])  # its own strategy: nothing to say
        load_config(None, [], base={"dist": {"checkpoint": "full", "strategy": "ddp"}})  # a resumed run's: not given now
    assert [str(w.message) for w in seen] == [
        "config keys dist.checkpoint, dist.reshard_after_forward: fsdp only, no effect under dist.strategy=ddp"]



@pytest.mark.parametrize("overrides, key, off", [
    (["guard.on_spike=remedy", "capture.spikes=false"], "guard.on_spike", "capture.spikes"),
    (["guard.on_spike=remedy", "capture.incidents=false"], "guard.on_spike", "capture.incidents"),
    (["guard.on_nonfinite=remedy", "capture.incidents=false"], "guard.on_nonfinite", "capture.incidents"),
])
def test_a_remedy_without_the_capture_it_is_searched_from_is_refused_naming_both_keys(overrides, key, off):
    """A new-user trial: guard.on_spike=remedy with capture.spikes=false ran, exit 0, every spike falling back to a skip."""
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert str(err.value) == (f"config key '{key}': remedy is searched from the incident's capture, but {off}=false "
                              f"(set {off}=true, or {key}=skip)")
    load_config(None, [overrides[0].replace("remedy", "skip"), overrides[1]])  # skipping needs no capture
    # a config read back from a run or a bundle written before the check still loads (diagnose, remedy, check resume)
    saved = config_to_dict(load_config(None, [overrides[0].replace("remedy", "skip"), overrides[1]]))
    section, _, name = key.partition(".")
    saved[section][name] = "remedy"
    assert getattr(getattr(config_from_dict(saved), section), name) == "remedy"


def test_a_spike_remedy_with_no_spike_capture_allowed_is_refused_too():
    """capture.max_spikes=0 captures no spike, as capture.spikes=false: guard.on_spike=remedy fell back on every spike."""
    with pytest.raises(ConfigError) as err:
        load_config(None, ["guard.on_spike=remedy", "capture.max_spikes=0"])
    assert str(err.value) == ("config key 'guard.on_spike': remedy is searched from the incident's capture, but "
                              "capture.max_spikes=0 (set capture.max_spikes=1 or more, or guard.on_spike=skip)")
    load_config(None, ["guard.on_nonfinite=remedy", "capture.max_spikes=0"])  # a NaN's capture is not a spike's


def test_a_key_of_literal_values_lists_them_once():
    """A trial: 'expected true or false or one of auto' for capture.memory_snapshot=sometimes."""
    with pytest.raises(ConfigError, match=r"^config key 'capture.memory_snapshot': expected true, false or auto, got "
                                          r"'sometimes'$"):
        load_config(None, ["capture.memory_snapshot=sometimes"])


def test_inf_for_a_number_key_says_how_yaml_writes_infinity():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["guard.spike_ratio=inf"])
    assert str(err.value) == ("config key 'guard.spike_ratio': expected a number, got 'inf' (YAML writes infinity .inf, "
                              "not-a-number .nan)")
    for key, want in (("guard.spike_ratio", "a finite number > 1"), ("guard.spike_zscore", "a finite number > 0")):
        with pytest.raises(ConfigError, match=rf"^config key '{key}': expected {want}, got inf$"):  # (a trial: .inf turned
            load_config(None, [f"{key}=.inf"])  # the spike rule off without a word)


def test_a_warmup_longer_than_the_run_is_said():
    """A new-user trial: train.max_steps=3 sched.warmup_steps=500 ran without a word, its lr 4e-6 .. 8e-6 of 1e-3."""
    from stabletrain.console import StableTrainWarning

    with pytest.warns(StableTrainWarning, match=r"^config key 'sched.warmup_steps': 500 > train.max_steps=3: the run ends "
                                                r"inside its warm-up, its lr never reaches the schedule's peak"):
        load_config(None, ["train.max_steps=3", "sched.warmup_steps=500"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(None, ["train.max_steps=3"])  # the default warm-up (20) in a smoke run: not the user's choice, silent
        load_config(None, ["train.max_steps=30", "sched.warmup_steps=20"])
        load_config(None, ["train.max_steps=20", "sched.warmup_steps=20"])  # its last step at the peak

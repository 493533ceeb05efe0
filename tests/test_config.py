"""Config: YAML + dotted overrides, every default written out, errors naming the dotted key and value."""

import pytest
import yaml

from stabletrain.config import Config, ConfigError, config_from_dict, config_to_dict, describe_keys, load_config


def test_defaults_and_overrides(tmp_path):
    path = tmp_path / "my.yaml"
    path.write_text("optim:\n  lr: 0.01\naccum:\n  steps: 2\ntask_args:\n  depth: 5\n")
    cfg = load_config(path, ["optim.lr=3e-4", "precision=bf16", "clip.max_norm=null", "task_args.width=8"])
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
    ("optim.lr=-1", "config key 'optim.lr': expected a number > 0, got -1.0"),
    ("accum.steps=0", "config key 'accum.steps': expected an integer >= 1, got 0"),
    ("accum.steps=2.5", "config key 'accum.steps': expected an integer, got 2.5"),
    ("precision=fp8", "config key 'precision': expected one of auto, fp32, bf16, fp16, got 'fp8'"),
    ("deterministic=maybe", "config key 'deterministic': expected true or false, got 'maybe'"),
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


def test_every_key_is_described():
    rows = describe_keys()
    keys = [k for k, _, _ in rows]
    for key in ["task", "seed", "deterministic", "precision", "train.max_steps", "train.batch_size", "accum.steps",
                "clip.max_norm", "optim.lr", "optim.weight_decay", "sched.warmup_steps", "log.every", "eval.every", "run.dir"]:
        assert key in keys
    assert all(help_text for _, _, help_text in rows)

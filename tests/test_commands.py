"""Each subcommand's parser and handler live together in its module under stabletrain.commands, without torch."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys

import pytest

from stabletrain import cli
from stabletrain.internals import parser_actions


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser_actions(cli.build_parser()) if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_subcommand_has_its_parser_and_handler_in_one_commands_module():
    assert list(_subcommands()) == ["train", "check", "diagnose", "remedy", "report", "compare", "tasks", "lab"]
    assert set(cli.COMMANDS) == set(_subcommands())
    for name, handler in cli.COMMANDS.items():
        module = importlib.import_module(handler.__module__)
        assert module.__name__.startswith("stabletrain.commands."), (name, module.__name__)
        assert handler.__name__ == f"cmd_{name}" and callable(getattr(module, f"add_{name}_parser", None)), name


def test_building_the_parsers_and_showing_their_help_does_not_import_torch():
    # check's too: its list of checks comes from the torch-free registry, not from the check modules.
    code = ("import contextlib, io, sys\n"
            "from stabletrain import cli\n"
            "for args in [[], *([n] for n in cli.COMMANDS), ['check', 'init']]:\n"
            "    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):\n"
            "        cli.main([*args, '--help'])\n"
            "    assert out.getvalue().startswith(' '.join(['usage: stabletrain', *args[:1]])), (args, out.getvalue())\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "[]"


@pytest.mark.parametrize("args, code, line", [
    (["check", "nosuch"], 2,
     "stabletrain: error: unknown check 'nosuch'; known checks: accum, amp, clip, init, nan, overfit, resume, determinism"),
    (["train", "task_args.depth=abc"], 2, "stabletrain: error: unknown config key 'task_args.depth' for task 'gpt' "
                                          "(it takes: n_layer, n_head, n_embd, seq_len, dropout, max_bytes)"),
    (["train", "task_args.nope=1"], 2, "stabletrain: error: unknown config key 'task_args.nope' for task 'gpt' "
                                       "(it takes: n_layer, n_head, n_embd, seq_len, dropout, max_bytes)"),
    (["train", "task=mlp", "task_args.depth=abc"], 2,
     "stabletrain: error: config key 'task_args.depth': expected an integer, got 'abc'"),
    (["check", "task=mlp", "task_args.activation=swish"], 2,
     "stabletrain: error: config key 'task_args.activation': expected one of relu, tanh, gelu, got 'swish'"),
])
def test_an_unknown_check_and_bad_builtin_task_args_are_one_line_without_torch(args, code, line):
    # The built-in tasks' arguments and the checks' names are known without torch: the error comes before it.
    script = ("import sys\n"
              "from stabletrain import cli\n"
              f"code = cli.main({args!r})\n"
              "print(code, sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert res.stdout.strip() == f"{code} []", (res.stdout, res.stderr[-2000:])
    assert res.stderr.splitlines() == [line]


def test_the_check_registry_is_what_the_check_modules_register():
    # check --help and --list read the registry; the checks run from their modules: the two must agree.
    from stabletrain import checks
    from stabletrain.checks.registry import BUILTIN_CHECKS

    checks._load_builtin_checks()
    builtin = {name: fn for name, fn in checks.CHECKS.items() if fn.__module__.startswith("stabletrain.checks.")}
    # (by name: the modules register in the order something first imported them, another test's import first)
    registered = {name: (fn.__doc__.strip().splitlines()[0], checks._ORDER[name], name in checks.DEFAULT_CHECKS)
                  for name, fn in builtin.items()}
    assert {c.name: (c.description, c.order, c.default) for c in BUILTIN_CHECKS} == registered
    assert [n for n in checks.DEFAULT_CHECKS if n in builtin] == [
        c.name for c in sorted(BUILTIN_CHECKS, key=lambda c: c.order) if c.default]


def test_check_help_and_list_show_every_check_in_order(capsys):
    from stabletrain.checks.registry import BUILTIN_CHECKS

    with pytest.raises(SystemExit):
        cli.main(["check", "--help"])
    help_text = capsys.readouterr().out
    listed = help_text.split("in this order):\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert [row.split()[0] for row in listed] == [c.name for c in sorted(BUILTIN_CHECKS, key=lambda c: c.order)]
    assert "  init         Report per-layer signal propagation at step 0 (and per init scheme with compare); pass if " \
           "nothing is flagged." in listed
    assert "(default: stabletrain-check/; created only" in " ".join(help_text.split())
    assert cli.main(["check", "--list"]) == 0  # (the help's order and words: it was alphabetical, with reST quotes)
    listing = capsys.readouterr().out.splitlines()
    assert [row.split()[0] for row in listing] == [row.split()[0] for row in listed]
    assert listing[:2] == [
        "overfit      Overfit one tiny fixed batch; name every trainable parameter that got no gradient.",
        "accum        Compare the gradient of k accumulated micro-batches with that of one big batch (fp32, train mode, "
        "dropout off)."] and "``" not in "\n".join(listing)


def test_the_end_lines_share_of_skipped_steps_never_reads_0_percent_for_a_skipped_step():
    from stabletrain.commands.train import share_text

    assert [share_text(p, w) for p, w in [(1, 300), (1, 12), (90, 100), (300, 300), (1, 30000), (0, 10)]] == [
        "0.3%", "8%", "90%", "100%", "0.003%", "0%"]

"""Each subcommand's parser and handler live together in its module under stabletrain.commands, without torch."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys

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
    # check's help lists the checks (torch): it is completed only when shown, so it is left out here.
    code = ("import contextlib, io, sys\n"
            "from stabletrain import cli\n"
            "for name in [None, *(n for n in cli.COMMANDS if n != 'check')]:\n"
            "    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):\n"
            "        cli.main([name, '--help'] if name else ['--help'])\n"
            "    assert out.getvalue().startswith('usage: stabletrain'), (name, out.getvalue())\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "[]"

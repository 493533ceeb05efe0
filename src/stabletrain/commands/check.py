"""``stabletrain check``: the doctor on the configured task (its help lists the checks, from a torch-free registry)."""

from __future__ import annotations

import argparse
import contextlib
import sys

from .. import console
from ..checks import DEFAULT_OUT_DIR, CheckContext, format_table, run_checks, to_json
from ..checks.registry import BUILTIN_CHECKS, require_known
from ..config import load_config
from . import keys_help

__all__ = ["cmd_check", "add_check_parser", "checks_help"]


def add_check_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="run the doctor: sanity checks on the configured task",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=keys_help(),
                       description="Run sanity checks (default: all) on the configured task; exit 1 if any fails."
                                   f"\n\n{checks_help()}")
    p.add_argument("names", nargs="*", metavar="CHECK|key=value",
                   help="checks to run (default: every default check); key=value items are config overrides")
    p.add_argument("--config", metavar="FILE", help="YAML config file")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--list", action="store_true", help="list the available checks and exit")
    p.add_argument("--compare", metavar="A,B,...", help="init check: compare these init schemes on one plot")
    p.add_argument("--out", "--out-dir", dest="out_dir", metavar="DIR", default=None,
                   help="where checks write files, such as init's init_signal.png and init_signal.json "
                        f"(default: {DEFAULT_OUT_DIR}/; created only when a check writes a file, with a .gitignore)")


def checks_help() -> str:
    """Return the list of checks the check command's help shows: each name and the first line of its docstring."""
    width = max(len(c.name) for c in BUILTIN_CHECKS)
    lines = ["checks (run by name; with none named, every one not marked otherwise, in this order):"]
    for c in sorted(BUILTIN_CHECKS, key=lambda c: (not c.default, c.order)):
        lines.append(f"  {c.name:<{width}}  {c.description.replace('``', '')}{'' if c.default else ' (not run by default)'}")
    return "\n".join(lines)


def _split_check_args(items: list[str]) -> tuple[list[str], list[str]]:
    names = [i for i in items if "=" not in i]
    overrides = [i for i in items if "=" in i]
    return names, overrides


def cmd_check(args: argparse.Namespace) -> int:
    names, overrides = _split_check_args(args.names)
    if args.list:  # (the help's order and words: run order, no reST quotes)
        for c in sorted(BUILTIN_CHECKS, key=lambda c: (not c.default, c.order)):
            print(f"{c.name:<12} {c.description.replace('``', '')}{'' if c.default else ' (not run by default)'}")
        return 0
    cfg = load_config(args.config, overrides)
    if ":" not in cfg.task:  # a name that is no check: one line, before the checks (and torch) are imported (a
        require_known(names)  # user's task module may register checks of its own: run_checks knows them once imported)
    compare = None
    if args.compare:  # a bad scheme is the command line's error (one line, exit 2), not the init check's failure
        from ..checks.init import compare_schemes

        compare = compare_schemes(args.compare)
        if names and "init" not in names:
            console.warn(f"--compare {args.compare} is the init check's, which is not run here (checks: {', '.join(names)})")
    if args.out_dir is not None:  # a file in the way is the command line's error, not every check's failure
        from ..fileio import check_folder

        check_folder(args.out_dir)
    options = {"compare": compare, "out_dir": args.out_dir}
    ctx = CheckContext(cfg, options=options)
    # --json: stdout holds the JSON alone; what the checks' runs and the task's own code print goes to stderr
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        ctx.preflight(names)  # (a device this machine lacks, a model with nothing to train: one line, not every check's)
        results = run_checks(ctx, names or None)
    print(to_json(results) if args.json else format_table(results))
    if ctx.written:  # stdout stays pure JSON under --json
        console.say(f"check files written to {ctx.out_dir}: {', '.join(p.name for p in ctx.written)}",
                    sys.stderr if args.json else sys.stdout)
    return 0 if all(r.passed for r in results) else 1

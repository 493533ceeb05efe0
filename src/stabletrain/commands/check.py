"""``stabletrain check``: the doctor on the configured task (its help lists the checks, imported when shown)."""

from __future__ import annotations

import argparse
import sys

from .. import console
from ..config import load_config
from . import keys_help

__all__ = ["cmd_check", "add_check_parser", "check_help"]


def add_check_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``check``; ``sub`` must make parsers that take ``help_later`` (the cli's): the list of checks imports torch."""
    p = sub.add_parser("check", help="run the doctor: sanity checks on the configured task",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=keys_help(),
                       description="Run sanity checks (default: all) on the configured task; exit 1 if any fails.",
                       help_later=check_help)
    p.add_argument("names", nargs="*", metavar="CHECK|key=value",
                   help="checks to run (default: every default check); key=value items are config overrides")
    p.add_argument("--config", metavar="FILE", help="YAML config file")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--list", action="store_true", help="list the available checks and exit")
    p.add_argument("--compare", metavar="A,B,...", help="init check: compare these init schemes on one plot")
    p.add_argument("--out", "--out-dir", dest="out_dir", metavar="DIR", default=None,
                   help="where checks write files, such as init's init_signal.png and init_signal.json "
                        "(default: {default}/; created only when a check writes a file, with a .gitignore)")


def check_help(check: argparse.ArgumentParser) -> None:
    """Complete the check command's help: the list of checks, and where they write by default."""
    from ..checks import DEFAULT_OUT_DIR
    from ..internals import parser_actions

    check.description = f"{check.description}\n\n{_checks_help()}"
    for action in parser_actions(check):
        if action.dest == "out_dir":
            action.help = action.help.format(default=DEFAULT_OUT_DIR)


def _checks_help() -> str:
    from ..checks import CHECKS, DEFAULT_CHECKS, _load_builtin_checks

    _load_builtin_checks()
    width = max(len(name) for name in CHECKS)
    lines = ["checks (run by name; with none named, every one not marked otherwise, in this order):"]
    for name in sorted(CHECKS, key=lambda n: DEFAULT_CHECKS.index(n) if n in DEFAULT_CHECKS else len(CHECKS)):
        fn = CHECKS[name]
        doc = (fn.__doc__ or "").strip().splitlines()
        line = doc[0].replace("``", "") if doc else ""
        lines.append(f"  {name:<{width}}  {line}{'' if name in DEFAULT_CHECKS else ' (not run by default)'}")
    return "\n".join(lines)


def _split_check_args(items: list[str]) -> tuple[list[str], list[str]]:
    names = [i for i in items if "=" not in i]
    overrides = [i for i in items if "=" in i]
    return names, overrides


def cmd_check(args: argparse.Namespace) -> int:
    names, overrides = _split_check_args(args.names)
    cfg = load_config(args.config, overrides) if not args.list else None  # torch: only once the config is valid
    from ..checks import CHECKS, CheckContext, _load_builtin_checks, format_table, run_checks, to_json

    _load_builtin_checks()
    if args.list:
        for name in CHECKS:
            doc = (CHECKS[name].__doc__ or "").strip().splitlines()
            print(f"{name:<12} {doc[0] if doc else ''}")
        return 0
    options = {"compare": args.compare.split(",") if args.compare else None, "out_dir": args.out_dir}
    ctx = CheckContext(cfg, options=options)
    results = run_checks(ctx, names or None)
    print(to_json(results) if args.json else format_table(results))
    if ctx.written:  # stdout stays pure JSON under --json
        console.say(f"check files written to {ctx.out_dir}: {', '.join(p.name for p in ctx.written)}",
                    sys.stderr if args.json else sys.stdout)
    return 0 if all(r.passed for r in results) else 1

"""``stabletrain tasks`` and ``stabletrain lab``: the built-in tasks with their arguments; the course's labs."""

from __future__ import annotations

import argparse

from .. import console

__all__ = ["cmd_tasks", "add_tasks_parser", "cmd_lab", "add_lab_parser", "tasks_help"]


def add_tasks_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tasks", help="list the built-in tasks and their task_args",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="List each built-in task (or the factory TASK) with its arguments: their "
                                   "types, defaults and meaning. Set one as task_args.NAME=VALUE.")
    p.add_argument("task", nargs="?", metavar="TASK", help="a built-in task or module:function (default: every built-in task)")


def tasks_help(specs: list[str]) -> str:
    """Return each task's first docstring line and its arguments: type, default and meaning."""
    from ..tasks import task_arguments, task_factory

    lines: list[str] = []
    for spec in specs:
        factory = task_factory(spec)
        doc = (factory.__doc__ or "").strip().splitlines()
        lines.append(f"task={spec}: {doc[0] if doc else ''}".rstrip())
        args = task_arguments(factory)
        if not args:
            lines.append("  (no arguments)")
        names = [f"task_args.{a.name}" for a in args]
        types = [a.type_text for a in args]
        defaults = ["(required)" if a.required else "null" if a.default is None else str(a.default) for a in args]
        widths = [max(map(len, col), default=0) for col in (names, types, defaults)]
        for a, n, t, d in zip(args, names, types, defaults):
            lines.append(f"  {n:<{widths[0]}}  {t:<{widths[1]}}  {d:<{widths[2]}}  {a.help}".rstrip())
        lines.append("")
    return "\n".join(lines).rstrip()


def cmd_tasks(args: argparse.Namespace) -> int:
    from ..tasks import BUILTIN_TASKS

    print(tasks_help([args.task] if args.task else list(BUILTIN_TASKS)))
    return 0


def add_lab_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lab", help="run the course chapter's exercises, measured and checked",
                       description="Without LAB: list the labs. With LAB (1-8, accept, or all): run it, print its "
                                   "numbers, the observations checked and an explanation written from the numbers, "
                                   "write its plots to --out; exit 1 if an observation does not hold. 'all' also "
                                   "writes DIR/index.html with every lab on one page.")
    p.add_argument("lab", nargs="?", metavar="LAB", help="1..8, accept or all (default: list the labs)")
    p.add_argument("--out", metavar="DIR", default="labs", help="where the plots (and index.html) go (default: labs)")
    p.add_argument("--list", action="store_true", help="list the labs and exit (as without LAB; as check --list)")


def cmd_lab(args: argparse.Namespace) -> int:
    from ..lab import LABS, format_list, format_result, run_lab

    if args.lab is None or args.list:
        print(format_list())
        return 0
    if args.lab != "all" and args.lab not in LABS:
        raise ValueError(f"unknown lab {args.lab!r}; the labs are {', '.join(LABS)} or all (stabletrain lab lists them)")
    results = []
    for key in list(LABS) if args.lab == "all" else [args.lab]:
        results.append(run_lab(key, args.out))
        print(format_result(results[-1]), end="\n\n", flush=True)
    if args.lab == "all":
        from ..lab.index import write_index

        console.say(f"{sum(r.passed for r in results)} of {len(results)} labs passed "
                    f"({sum(r.seconds for r in results):.0f} s); index written to {write_index(results, args.out)}")
    return 0 if all(r.passed for r in results) else 1

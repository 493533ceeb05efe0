"""``stabletrain tasks`` and ``stabletrain lab``: the built-in tasks with their arguments; the course's labs."""

from __future__ import annotations

import argparse

from .. import console

__all__ = ["cmd_tasks", "cmd_lab", "tasks_help"]


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


def cmd_lab(args: argparse.Namespace) -> int:
    from ..lab import LABS, format_list, format_result, run_lab

    if args.lab is None:
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

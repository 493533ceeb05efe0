"""The ``stabletrain`` command line: train, check, diagnose, remedy, report, compare.

A user error (bad config key or value, missing file, unusable task) prints one line
``stabletrain: error: ...`` and exits with code 2; an exception raised in the task's own code (its
factory, a dataset item, the collate, the loss, the model's forward) names that part, shows the
user's frames (file:line; stabletrain's and torch's trimmed) and exits with code 1; a failed check
exits with code 1.

``--version``, ``--help`` (and ``train --help``) and a config that does not validate answer without importing
torch: what needs it is imported inside the command that uses it (a test runs them under ``-X importtime``).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from . import console
from ._version import __version__
from .config import ConfigError, describe_keys, load_config, load_yaml, resume_safe_text
from .errors import format_task_error, raised_by_stabletrain, task_part
from .commands.remedy import add_remedy_parser, cmd_remedy

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose help may be completed when it is shown: ``help_later(parser)`` runs then, once.

    The check command's help lists the checks, which imports them (and torch); ``--version``, ``--help`` and
    a config error must not wait for that.
    """

    def __init__(self, *args, help_later=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._help_later = help_later

    def format_help(self) -> str:
        if self._help_later is not None:
            self._help_later(self)
            self._help_later = None
        return super().format_help()


def _loaded_instance(err: BaseException, module: str, name: str) -> bool:
    """Whether ``err`` is a ``module.name`` — False when that module was never imported (then nothing raised one)."""
    cls = getattr(sys.modules.get(module), name, None)
    return isinstance(cls, type) and isinstance(err, cls)


def _keys_help() -> str:
    rows = describe_keys()
    width = max(len(k) for k, _, _ in rows)
    lines = ["config keys (set in --config YAML or as dotted key=value overrides):", ""]
    for key, default, help_text in rows:
        wrapped = textwrap.wrap(help_text, 100 - width - 4) or [""]
        lines.append(f"  {key:<{width}}  {wrapped[0]}")
        lines.extend(f"  {'':<{width}}  {w}" for w in wrapped[1:])
        lines.append(f"  {'':<{width}}  default: {default}")
    return "\n".join(lines)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="YAML config file; overrides on the command line win")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides, e.g. optim.lr=3e-4 accum.steps=4")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="stabletrain",
        description="Make PyTorch training stable, observable and debuggable.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=textwrap.dedent("""\
            examples:
              stabletrain train                                   # the default task (byte-level GPT on stdlib sources)
              stabletrain train --config my.yaml optim.lr=3e-4 accum.steps=4 precision=bf16
              stabletrain train task=mypkg.mymodule:make_task     # your own model and data
              stabletrain train dist.nproc=2                      # DDP on this machine (launches torchrun)
              torchrun --nproc_per_node=2 -m stabletrain train    # the same, under your own torchrun
              stabletrain check                                   # the doctor, on the configured task
              stabletrain report runs/gpt-20260101-120000         # an HTML report of a run
            """),
    )
    parser.add_argument("--version", action="version", version=f"stabletrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    train = sub.add_parser("train", help="train a task and write its run directory",
                           formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_keys_help(),
                           description="Train the configured task; write config, snapshot, metrics, events and TensorBoard logs.")
    _add_config_args(train)
    train.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its LAST_GOOD checkpoint (same as resume=RUN_DIR); "
                       f"its config.yaml is the base, and only these keys may change on resume: {resume_safe_text()}")
    train.add_argument("--report", action="store_true", help="write RUN_DIR/report.html at the end of training")

    check = sub.add_parser("check", help="run the doctor: sanity checks on the configured task",
                           formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_keys_help(),
                           description="Run sanity checks (default: all) on the configured task; exit 1 if any fails.",
                           help_later=_check_help)
    check.add_argument("names", nargs="*", metavar="CHECK|key=value",
                       help="checks to run (default: every default check); key=value items are config overrides")
    check.add_argument("--config", metavar="FILE", help="YAML config file")
    check.add_argument("--json", action="store_true", help="print the results as JSON")
    check.add_argument("--list", action="store_true", help="list the available checks and exit")
    check.add_argument("--compare", metavar="A,B,...", help="init check: compare these init schemes on one plot")
    check.add_argument("--out", "--out-dir", dest="out_dir", metavar="DIR", default=None,
                       help="where checks write files, such as init's init_signal.png and init_signal.json "
                            "(default: {default}/; created only when a check writes a file, with a .gitignore)")

    diagnose = sub.add_parser("diagnose", help="replay a captured incident and name the first non-finite op, module, parameter and sample",
                              description="Replay RUN_DIR/incidents/step_N under the precise tools; write diagnosis.json next to it.")
    diagnose.add_argument("incident", metavar="INCIDENT_DIR", help="RUN_DIR/incidents/step_N (or RUN_DIR: its newest incident)")
    diagnose.add_argument("--json", action="store_true", help="print the whole diagnosis as JSON")
    diagnose.add_argument("--device", metavar="DEVICE", help="replay on this device (default: the run's)")
    diagnose.add_argument("--no-bisect", action="store_true", help="skip the bisection over the batch's samples")

    add_remedy_parser(sub)

    report = sub.add_parser("report", help="write RUN_DIR/report.html from a run directory",
                            description="Write RUN_DIR/report.html, one self-contained page (no network): a health "
                                        "summary, the curves (loss, grad norm, clip rate, LR, loss scale, throughput, "
                                        "memory), the events (skips, clips, spikes, incidents, checkpoints, resumes), "
                                        "the layers dominating the grad norm, the config and the snapshot; and each "
                                        "plot as RUN_DIR/plots/NAME.png. Reads only the run directory's files (it works "
                                        "on a run in progress too); prints the health summary.")
    report.add_argument("run_dir", metavar="RUN_DIR")

    compare = sub.add_parser("compare", help="compare runs: config differences and overlaid curves",
                             description="Write one self-contained HTML page comparing two or more runs: the config "
                                         "keys that differ, the code, libraries, device and data that differ, a "
                                         "summary per run, and the curves (loss, val loss, grad norm, clip rate, LR, "
                                         "...) overlaid by step and by tokens (or samples) seen; each plot is also "
                                         "written as PAGE_STEM_plots/METRIC.png next to the page. Writes nothing to "
                                         "the current directory unless --out says so.")
    compare.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    compare.add_argument("--out", metavar="DIR|FILE.html",
                         help="a directory (the page is DIR/compare.html) or an .html file (default: the first run's "
                              "directory, RUN_DIR/compare.html: the first run is the baseline)")

    tasks = sub.add_parser("tasks", help="list the built-in tasks and their task_args",
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           description="List each built-in task (or the factory TASK) with its arguments: their "
                                       "types, defaults and meaning. Set one as task_args.NAME=VALUE.")
    tasks.add_argument("task", nargs="?", metavar="TASK", help="a built-in task or module:function (default: every built-in task)")

    lab = sub.add_parser("lab", help="run the course chapter's exercises, measured and checked",
                         description="Without LAB: list the labs. With LAB (1-6, accept, or all): run it, print its "
                                     "numbers, the observations checked and an explanation written from the numbers, "
                                     "write its plots to --out; exit 1 if an observation does not hold. 'all' also "
                                     "writes DIR/index.html with every lab on one page.")
    lab.add_argument("lab", nargs="?", metavar="LAB", help="1..6, accept or all (default: list the labs)")
    lab.add_argument("--out", metavar="DIR", default="labs", help="where the plots (and index.html) go (default: labs)")
    return parser


def _check_help(check: argparse.ArgumentParser) -> None:
    """Complete the check command's help: the list of checks, and where they write by default."""
    from .checks import DEFAULT_OUT_DIR
    from .internals import parser_actions

    check.description = f"{check.description}\n\n{_checks_help()}"
    for action in parser_actions(check):
        if action.dest == "out_dir":
            action.help = action.help.format(default=DEFAULT_OUT_DIR)


def _checks_help() -> str:
    from .checks import CHECKS, DEFAULT_CHECKS, _load_builtin_checks

    _load_builtin_checks()
    width = max(len(name) for name in CHECKS)
    lines = ["checks (run by name; with none named, every one not marked otherwise, in this order):"]
    for name in sorted(CHECKS, key=lambda n: DEFAULT_CHECKS.index(n) if n in DEFAULT_CHECKS else len(CHECKS)):
        fn = CHECKS[name]
        doc = (fn.__doc__ or "").strip().splitlines()
        line = doc[0].replace("``", "") if doc else ""
        lines.append(f"  {name:<{width}}  {line}{'' if name in DEFAULT_CHECKS else ' (not run by default)'}")
    return "\n".join(lines)


def tasks_help(specs: list[str]) -> str:
    """Return each task's first docstring line and its arguments: type, default and meaning."""
    from .tasks import task_arguments, task_factory

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


def _split_check_args(items: list[str]) -> tuple[list[str], list[str]]:
    names = [i for i in items if "=" not in i]
    overrides = [i for i in items if "=" in i]
    return names, overrides


def _resume_target(args: argparse.Namespace) -> str | None:
    if args.resume:
        return args.resume
    for item in args.overrides:
        if item.startswith("resume="):
            return item.split("=", 1)[1] or None
    return None


def cmd_train(args: argparse.Namespace) -> int:
    resume = _resume_target(args)
    if resume:
        saved = Path(resume) / "config.yaml"
        if not saved.exists():
            raise FileNotFoundError(f"resume {resume!r}: no config.yaml there; is it a stabletrain run directory?")
        base = load_yaml(saved.read_text(encoding="utf-8"), f"config file {str(saved)!r}") or {}
        cfg = load_config(args.config, [*args.overrides, f"resume={resume}", f"run.dir={resume}"], base=base)
        run_dir = Path(resume)
    else:
        cfg = load_config(args.config, args.overrides)
        run_dir = Path(cfg.run.dir) if cfg.run.dir else None  # None: runs/<Task.name>-<timestamp>
    from .distributed import launch as launcher  # no torch: a launcher or a supervisor does not hold it

    # The ranks, and every restart, must agree on the run directory: name it here, once.
    argv = list(getattr(args, "argv", None) or sys.argv[1:])
    if not resume and not cfg.run.dir:
        argv.append(f"run.dir={launcher.default_run_dir(cfg)}")
    if cfg.dist.nproc > 1 and not launcher.under_torchrun():
        console.say(f"starting {cfg.dist.nproc} processes on this machine (torchrun, {cfg.dist.strategy.upper()}): rank 0 "
                    "prints the progress and writes the run directory")
        return launcher.launch(cfg.dist.nproc, argv, max_restarts=cfg.run.max_restarts)
    if cfg.run.max_restarts and not launcher.restarted_by_parent():
        return launcher.supervise(argv, max_restarts=cfg.run.max_restarts)
    from .distributed import ddp as distributed  # torch: only once the config is valid, in a process that trains
    from .services.restarts import begin_launch

    with distributed.process_group(cfg.dist.backend, cfg.dist.timeout_s, cfg.dist.nproc) as ctx:
        launch = begin_launch(cfg, run_dir, bool(resume), ctx)  # run.resume=auto, and a restart's checks and record
        if launch.refused:
            return launcher.EXIT_GAVE_UP
        return _train(args, cfg, launch.run_dir, launch.resume, ctx)


def _train(args: argparse.Namespace, cfg, run_dir: Path | None, resume: bool, ctx) -> int:
    from .loop import Trainer
    from .services.run_setup import DEFAULT_RUN_DIR

    trainer = Trainer(cfg, run_dir=run_dir if run_dir is not None else DEFAULT_RUN_DIR, resume=resume)
    run_dir = trainer.run.path if trainer.run is not None else run_dir
    try:
        record = trainer.fit()
    except KeyboardInterrupt:  # a second signal: out at once; say what is safe to resume from
        good = trainer.ckpt.latest_good() if trainer.ckpt is not None else None
        if ctx.is_main:
            where = (f"LAST_GOOD is {good.name}; resume with: stabletrain train --resume {run_dir}" if good
                     else "no checkpoint was written")
            console.say(f"interrupted at step {trainer.step}; {where}", sys.stderr)
        return 130
    except Exception as err:
        if ctx.is_main and trainer.run is not None:  # the loop recorded a 'crash' event: say where to read it
            note = f"(recorded in {run_dir}; see: stabletrain report {run_dir})"
            err.__notes__ = [*getattr(err, "__notes__", []), note]  # err.add_note(note), which Python 3.10 lacks
        raise
    signalled = trainer.signals.received is not None
    if not ctx.is_main:
        return 1 if trainer.stop_reason is not None and not signalled else 0
    if trainer.stop_reason is not None and signalled:
        console.say(f"{trainer.stop_reason}; checkpointed. Resume with: stabletrain train --resume {run_dir}")
        return 0
    if trainer.stop_reason is not None:
        console.say(f"the run stopped early: {trainer.stop_reason}. See {run_dir / 'events.jsonl'} and "
                    f"{run_dir / 'incidents'}", sys.stderr)
        return 1
    shown = ", ".join(f"{k}={record[k]:.4g}" for k in ("loss", "val_loss", "grad_norm") if isinstance(record.get(k), float))
    skipped = sum(int(r.get("num_skipped", 0)) for r in trainer.history)
    skipped_note = (f"{skipped} of {trainer.step} steps skipped ({100 * skipped / max(trainer.step, 1):.0f}%: see events.jsonl)"
                    if skipped else "no step skipped")
    console.say(f"trained {trainer.step} steps; {shown}; {skipped_note}; run directory: {run_dir}")
    if args.report:
        _write_report(run_dir)
    return 0


def _write_report(run_dir: Path) -> None:
    from .report import health_summary, load_run, write_report

    from .report.goodput import read_goodput

    console.say(f"report written to {write_report(run_dir)}")
    print(health_summary(load_run(run_dir)).text)
    goodput = read_goodput(run_dir)
    if goodput is not None:
        print(goodput.line())


def cmd_check(args: argparse.Namespace) -> int:
    names, overrides = _split_check_args(args.names)
    cfg = load_config(args.config, overrides) if not args.list else None  # torch: only once the config is valid
    from .checks import CHECKS, CheckContext, _load_builtin_checks, format_table, run_checks, to_json

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


def cmd_report(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.exists():
        raise FileNotFoundError(f"run directory {str(run_dir)!r} does not exist")
    if not (run_dir / "metrics.jsonl").exists() and not (run_dir / "config.yaml").exists():
        raise FileNotFoundError(f"run directory {str(run_dir)!r}: no metrics.jsonl or config.yaml there; is it a stabletrain run?")
    _write_report(run_dir)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from .report import write_compare

    for d in args.run_dirs:
        if not Path(d).exists():
            raise FileNotFoundError(f"run directory {d!r} does not exist")
        if not (Path(d) / "metrics.jsonl").exists():
            raise FileNotFoundError(f"run directory {d!r}: no metrics.jsonl there; is it a stabletrain run?")
    page = write_compare(args.run_dirs, args.out)
    console.say(f"comparison written to {page} (plots in {page.with_name(page.stem + '_plots')})")
    return 0


def cmd_tasks(args: argparse.Namespace) -> int:
    from .tasks import BUILTIN_TASKS

    print(tasks_help([args.task] if args.task else list(BUILTIN_TASKS)))
    return 0


def cmd_lab(args: argparse.Namespace) -> int:
    from .lab import LABS, format_list, format_result, run_lab

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
        from .lab.index import write_index

        console.say(f"{sum(r.passed for r in results)} of {len(results)} labs passed "
                    f"({sum(r.seconds for r in results):.0f} s); index written to {write_index(results, args.out)}")
    return 0 if all(r.passed for r in results) else 1


def _rank_prefix() -> str:
    import os

    return f"rank {os.environ['RANK']}: " if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ else ""


def cmd_diagnose(args: argparse.Namespace) -> int:
    from .commands.diagnose import cmd_diagnose as diagnose

    return diagnose(args)


COMMANDS = {"train": cmd_train, "check": cmd_check, "diagnose": cmd_diagnose, "remedy": cmd_remedy, "report": cmd_report,
            "compare": cmd_compare, "tasks": cmd_tasks, "lab": cmd_lab}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # key=value overrides may come after options (argparse stops collecting positionals at an option).
    args, extra = parser.parse_known_args(argv)
    stray = [e for e in extra if "=" not in e or e.startswith("-")]
    if stray or (extra and args.command not in ("train", "check")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        target = "overrides" if args.command == "train" else "names"
        setattr(args, target, [*getattr(args, target), *extra])
    if args.command is None:
        parser.print_help()
        return 2
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # passed on to torchrun by dist.nproc
    try:
        with console.one_line_warnings():  # stabletrain's own warnings as one line (the CLI only, never the library)
            code = COMMANDS[args.command](args)
            sys.stdout.flush()  # a reader that left (`| head`) shows here, not at the interpreter's exit
        return code
    except KeyboardInterrupt:
        console.say("interrupted", sys.stderr)
        return 130
    except Exception as err:
        if _loaded_instance(err, "stabletrain.distributed.ddp", "PeerLostError"):  # (torch's module: loaded if raised)
            console.error(str(err))  # a rank died or hung: one clear line per surviving rank, exit 1
            return 1
        if isinstance(err, BrokenPipeError) and _stdout_gone():
            return _quiet_exit_on_closed_stdout()
        code = _report_error(err)
        if code is None:
            raise  # neither the task's code nor input stabletrain rejects: a bug, with its whole traceback
        return code


def _stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader has left (``stabletrain diagnose RUN | head``)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), or no file descriptor: assume it is
        return True


def _quiet_exit_on_closed_stdout() -> int:
    """Exit as ``git log | head`` does: no traceback, and nothing more written to the closed pipe.

    stdout is pointed at /dev/null so that the interpreter's last flush cannot fail again; the exit
    code is 141 (128 + SIGPIPE), what a shell reports for a writer killed by the closed pipe.
    """
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):
        pass
    finally:
        os.close(devnull)
    return 141


def _report_error(err: Exception) -> int | None:
    """Print ``err`` for a user; return the exit code, or None when it needs its full traceback.

    What stabletrain rejects (config, task contract, files, checkpoints: its own exceptions, and the
    ValueErrors and TypeErrors it raises itself) is one line, exit 2. An exception from the task's own
    code (any type) names the part of the task that raised it and shows the user's frames, exit 1.
    """
    if isinstance(err, ConfigError) or _loaded_instance(err, "stabletrain.tasks", "TaskError") \
            or _loaded_instance(err, "stabletrain.records.checkpoint.files", "CheckpointError"):
        console.error(f"{_rank_prefix()}{err}")
        return 2
    part = task_part(err)
    if part is not None:
        console.error(f"{_rank_prefix()}{format_task_error(err, part)}")
        return 1
    if isinstance(err, (FileNotFoundError, FileExistsError)) or (isinstance(err, (ValueError, TypeError))
                                                                 and raised_by_stabletrain(err)):
        console.error(f"{_rank_prefix()}{err}")
        return 2
    return None


if __name__ == "__main__":
    sys.exit(main())

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

from . import console
from ._version import __version__
from .commands.check import check_help as _check_help
from .commands.check import cmd_check
from .commands.listing import cmd_lab, cmd_tasks
from .commands.pages import cmd_compare, cmd_report
from .commands.remedy import add_remedy_parser, cmd_remedy
from .commands.train import cmd_train
from .config import ConfigError, describe_keys, resume_safe_text
from .errors import format_task_error, raised_by_stabletrain, task_part

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
    train.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its LAST_GOOD checkpoint "
                       "(same as resume=RUN_DIR); "
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

    diagnose = sub.add_parser("diagnose",
                              help="replay a captured incident and name its cause: a NaN/Inf's op, module, parameter and "
                                   "sample, a loss spike's class and evidence",
                              description="Replay RUN_DIR/incidents/step_N under the precise tools (a loss spike: under "
                                          "counterfactual replays); write diagnosis.json next to it.")
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
    tasks.add_argument("task", nargs="?", metavar="TASK",
                       help="a built-in task or module:function (default: every built-in task)")

    lab = sub.add_parser("lab", help="run the course chapter's exercises, measured and checked",
                         description="Without LAB: list the labs. With LAB (1-6, accept, or all): run it, print its "
                                     "numbers, the observations checked and an explanation written from the numbers, "
                                     "write its plots to --out; exit 1 if an observation does not hold. 'all' also "
                                     "writes DIR/index.html with every lab on one page.")
    lab.add_argument("lab", nargs="?", metavar="LAB", help="1..6, accept or all (default: list the labs)")
    lab.add_argument("--out", metavar="DIR", default="labs", help="where the plots (and index.html) go (default: labs)")
    return parser


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
        if _loaded_instance(err, "stabletrain.distributed.peers", "PeerLostError"):  # (torch's module: loaded if raised)
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

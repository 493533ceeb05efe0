"""The ``stabletrain`` command line: train, check, diagnose, remedy, report, compare, tasks, lab.

Here: the top-level parser, the dispatch and the error handling every command shares; each subcommand's parser
(``add_NAME_parser``) and handler (``cmd_NAME``) live together in its module under :mod:`stabletrain.commands`.

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
import re
import sys
import textwrap
import traceback

from . import console
from ._version import __version__
from .commands.check import add_check_parser, cmd_check
from .commands.diagnose import add_diagnose_parser, cmd_diagnose
from .commands.listing import add_lab_parser, add_tasks_parser, cmd_lab, cmd_tasks
from .commands.pages import add_compare_parser, add_report_parser, cmd_compare, cmd_report
from .commands.remedy import add_remedy_parser, cmd_remedy
from .commands.train import add_train_parser, cmd_train
from .config import ConfigError
from .errors import clean_exit, exit_call, format_task_error, raised_by_stabletrain, task_part

__all__ = ["main"]


def _loaded_instance(err: BaseException, module: str, name: str) -> bool:
    """Whether ``err`` is a ``module.name`` — False when that module was never imported (then nothing raised one)."""
    cls = getattr(sys.modules.get(module), name, None)
    return isinstance(cls, type) and isinstance(err, cls)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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

    for add_parser in (add_train_parser, add_check_parser, add_diagnose_parser, add_remedy_parser, add_report_parser,
                       add_compare_parser, add_tasks_parser, add_lab_parser):  # in the order --help lists them
        add_parser(sub)
    parser.set_defaults(subcommands=sub.choices)  # (a stray argument is the subcommand's: its usage, not the top's)
    return parser


def _rank_prefix() -> str:
    import os

    return f"rank {os.environ['RANK']}: " if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ else ""


COMMANDS = {"train": cmd_train, "check": cmd_check, "diagnose": cmd_diagnose, "remedy": cmd_remedy, "report": cmd_report,
            "compare": cmd_compare, "tasks": cmd_tasks, "lab": cmd_lab}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # key=value overrides may come after options (argparse stops collecting positionals at an option).
    args, extra = parser.parse_known_args(argv)
    stray = [e for e in extra if "=" not in e or e.startswith("-")]
    if stray or (extra and args.command not in ("train", "check")):
        hint = ("; report takes one run directory (several runs side by side: stabletrain compare RUN_A RUN_B ...)"
                if args.command == "report" else "")
        (args.subcommands.get(args.command) or parser).error(f"unrecognized arguments: {' '.join(stray or extra)}{hint}")
    if extra:
        target = "overrides" if args.command == "train" else "names"
        setattr(args, target, [*getattr(args, target), *extra])
    if args.command is None:
        parser.print_help()
        return 2
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # passed on to torchrun by dist.nproc
    args.cli_says_last = True  # (train's late SIGTERM is put back below, once its last line is said)
    try:
        with console.one_line_warnings():  # stabletrain's own warnings as one line (the CLI only, never the library)
            code = COMMANDS[args.command](args)
            sys.stdout.flush()  # a reader that left (`| head`) shows here, not at the interpreter's exit
        return code
    except KeyboardInterrupt:
        console.say("interrupted", sys.stderr)
        return 130
    except SystemExit as err:  # the task's own code (a library's sys.exit): said where; its exit, not stabletrain's
        part = task_part(err)  # decision (raised on: no launcher takes its code for a refusal, it restarts it)
        if part is not None and not clean_exit(err):
            console.error(f"{_rank_prefix()}{format_task_error(err, part)}")
            if not isinstance(err.code, int):  # (said above: Python would print the message again on its way out)
                raise SystemExit(1) from None
        elif part is not None:  # sys.exit(0): an end the task asked for, said as the stop it is, not as an error
            head, *_ = format_task_error(err, part).splitlines()
            head = head.replace(" raised SystemExit", f" ended the process ({exit_call(err)})", 1)
            notes = "".join(f" {note}" for note in getattr(err, "__notes__", ()))
            if args.command != "train":  # (check, diagnose, remedy: cut short, no verdict; not a pass, exit 1)
                console.error(f"{_rank_prefix()}{head}: stabletrain {args.command} did not finish (no result){notes}")
                return 1
            trained = getattr(err, "stabletrain_step", None) is not None  # (raised in the loop: its stop is recorded)
            console.say(f"{_rank_prefix()}{head}: " + ("the run stopped there, unfinished (a stop event; --resume continues "
                        "it)" if trained else "before training began: nothing was trained or recorded") + notes, sys.stderr)
        raise
    except Exception as err:
        if _loaded_instance(err, "stabletrain.distributed.peers", "PeerLostError"):  # (torch's module: loaded if raised)
            # A rank died or hung: one clear line per surviving rank, exit 1 (an error, unless the launch restarts: then
            # the news that it does, not a failure of the run; none under stabletrain's launcher, whose one restart line
            # quotes it: a new user saw two lines for one restart)
            if not getattr(err, "quiet", False):
                console.say(str(err), sys.stderr) if getattr(err, "restarts", False) else console.error(str(err))
            return 1
        if isinstance(err, BrokenPipeError) and _stdout_gone():
            return _quiet_exit_on_closed_stdout()
        code = _report_error(err, _in_config_file(err, args))
        if code is None:
            if getattr(getattr(args, "late_sigterm", None), "seen", False):  # a SIGTERM held ends the process in the
                traceback.print_exc()  # finally below, before Python would print this: print it first
                sys.stderr.flush()
                return 1
            raise  # neither the task's code nor input stabletrain rejects: a bug, with its whole traceback
        return code
    finally:
        if getattr(args, "late_sigterm", None) is not None:  # train's: a SIGTERM after its fit, held until said
            args.late_sigterm.restore()


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


#: How long a rank that leaves an error for rank 0 to say waits before it exits (see :func:`_report_error`).
SILENT_RANK_WAIT_S = 3.0


def _in_config_file(err: Exception, args: argparse.Namespace) -> str:
    """``config file 'F', line N: `` where a task's own argument (``task_args.X``, checked once the task is built, not
    when the file is read) came from the --config file, not the command line, as every other key of a file is named."""
    import re

    found = re.search(r"'(task_args\.[\w.]+)'", str(err)) if _loaded_instance(err, "stabletrain.tasks", "TaskError") else None
    path = getattr(args, "config", None)
    given = [o.partition("=")[0] for o in [*getattr(args, "overrides", []), *getattr(args, "names", [])]]
    if found is None or not path or any(found.group(1) == k or found.group(1).startswith(f"{k}.") for k in given):
        return ""
    from .config.loading import key_line

    line = key_line(path, found.group(1))
    return f"config file {str(path)!r}, line {line}: " if line else ""


def _report_error(err: Exception, where: str = "") -> int | None:
    """Print ``err`` for a user; return the exit code, or None when it needs its full traceback.

    What stabletrain rejects (config, task contract, files, checkpoints: its own exceptions, and the
    ValueErrors and TypeErrors it raises itself) is one line, exit 2. An exception from the task's own
    code (any type) names the part of the task that raised it and shows the user's frames, exit 1.
    """
    import os

    # Every rank reads the same config: rank 0 says a ConfigError; a value this machine cannot run (device=cuda, nccl)
    # is said by each machine's local rank 0 (two ranks' lines ran into one; another node's cause would go unsaid).
    if _rank_prefix() not in ("", "rank 0: ") and (isinstance(err, ConfigError) or (
            str(err).startswith("config key ") and os.environ.get("LOCAL_RANK", "0") != "0")):
        import time

        # This rank's exit has torchrun stop the others at once: rank 0 was stopped before it said it (exit 2, no line,
        # seen under load). A moment for rank 0 to say it and exit first (then torchrun stops this rank in its wait).
        time.sleep(SILENT_RANK_WAIT_S)
        return 2
    if isinstance(err, ConfigError) or _loaded_instance(err, "stabletrain.tasks", "TaskError") \
            or _loaded_instance(err, "stabletrain.records.checkpoint.files", "CheckpointError"):
        console.error(f"{_rank_prefix()}{where}{err}")  # (where: a task argument's line in the config file)
        return 2
    # (torch's, raised anywhere in the step; or a worker gone while its batch's shared memory was handed over: the
    # connection to it reset in torch's rebuild of the batch's storage, seen once in CI)
    handoff = (isinstance(err, (ConnectionError, EOFError, FileNotFoundError))  # (the fd's socket of a worker gone)
               and _raised_in(err, "torch/multiprocessing/reductions.py"))
    death = _worker_death(err)  # (torch's SIGCHLD handler's, raised into whatever ran: another error may carry it)
    if death is not None or handoff:
        said = (f"its batch's shared memory could not be received ({type(err).__name__}: {err})" if death is None
                else str(death).strip().split(". Details are lost")[0].rstrip("."))
        code = re.search(r"exited unexpectedly with exit code (\d+)", said)
        why = (f"an exit with code {code[1]} is the worker's own (a sys.exit or os._exit in the dataset's code, or a "
               "library's it calls)" if code else "a Python error in the dataset would name its line: this is a death "
               "from outside Python (a signal: the out-of-memory killer?), in native code, or an exit of its own (a sys.exit "
               "or os._exit in the dataset's code)")
        console.error(f"{_rank_prefix()}a data loader worker process (data.workers) died: {said}. {why[0].upper()}{why[1:]}; "
                      "with data.workers=0 the data is read in the training process, where its line is named"
                      + "".join(f"\n{note}" for note in getattr(err, "__notes__", ())))
        return 1
    part = task_part(err)
    if part is not None:
        console.error(f"{_rank_prefix()}{format_task_error(err, part)}")
        return 1
    if isinstance(err, (FileNotFoundError, FileExistsError)) or (isinstance(err, (ValueError, TypeError))
                                                                 and raised_by_stabletrain(err)):
        console.error(f"{_rank_prefix()}{err}")
        return 2
    return None


def _worker_death(err: BaseException) -> BaseException | None:
    """torch's error for a DataLoader worker gone ('DataLoader worker (pid ...) exited unexpectedly ...'), ``err`` itself
    or one it was raised in the handling of (the SIGCHLD handler raises into any bytecode: a FileNotFoundError of a
    batch's shared memory was the run's error, exit 2 as if input were refused); the one that names an exit code first."""
    found, seen = [], set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, RuntimeError) and str(err).startswith("DataLoader worker"):
            found.append(err)
        err = err.__cause__ or err.__context__
    return next((e for e in found if "exit code" in str(e)), found[0] if found else None)


def _raised_in(err: BaseException, path: str) -> bool:
    """Whether a frame of ``err``'s traceback runs in a file whose path ends with ``path`` ('/'-separated)."""
    import os

    tb, tail = err.__traceback__, path.replace("/", os.sep)
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(tail):
            return True
        tb = tb.tb_next
    return False


if __name__ == "__main__":
    sys.exit(main())

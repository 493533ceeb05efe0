"""``stabletrain train``: load the config, launch (torchrun, a supervisor) or train here, say how it ended."""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .. import console
from ..config import RESHARD_SAFE_KEYS, load_config, load_yaml, resume_safe_text
from . import keys_help

if TYPE_CHECKING:
    from ..report.rundata import RunData

__all__ = ["cmd_train", "add_train_parser", "write_report", "share_text"]


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a task and write its run directory",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=keys_help(),
                       description="Train the configured task; write config, snapshot, metrics, events and TensorBoard logs.")
    p.add_argument("--config", metavar="FILE", help="YAML config file; overrides on the command line win")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides, e.g. optim.lr=3e-4 accum.steps=4")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its LAST_GOOD checkpoint "
                   "(same as resume=RUN_DIR); "
                   f"its config.yaml is the base, and only these keys may change on resume: {resume_safe_text()} "
                   f"(on another number of processes, dist.*, also {resume_safe_text(RESHARD_SAFE_KEYS)})")
    p.add_argument("--report", action="store_true", help="write RUN_DIR/report.html at the end of training")


def _resume_target(args: argparse.Namespace) -> str | None:
    given = [item.split("=", 1)[1] for item in args.overrides if item.startswith("resume=")]
    if not given and args.config:  # the config file's own 'resume:' (it trained a fresh run without a word)
        try:
            data = load_yaml(Path(args.config).read_text(encoding="utf-8"), args.config)
        except (OSError, ValueError):  # (load_config says what is wrong with the file)
            data = None
        given = [str(data["resume"])] if isinstance(data, dict) and data.get("resume") else []
    if args.resume:
        if given and given[-1] and Path(given[-1]).resolve() != Path(args.resume).resolve():
            raise ValueError(f"config key 'resume': {given[-1]!r}, but --resume {args.resume!r} continues another run: "
                             "give one of them")
        return args.resume
    return (given[-1] or None) if given else None


def _same_world(cfg, run: Path, overrides: list[str]) -> None:
    """Refuse a plain --resume on one process of a run whose last launch was a torchrun of the user's own on several (its
    config.yaml says dist.nproc=1: a trial's resume halved the global batch with an informational line)."""
    from ..distributed.launch import under_torchrun
    from ..records.launches import last_launch

    try:
        world = int(last_launch(run).get("world_size") or 1)
    except (TypeError, ValueError):
        return
    if world > 1 and cfg.dist.nproc == 1 and not under_torchrun() and not any(o.startswith("dist.nproc=") for o in overrides):
        per_rank = cfg.train.batch_size * cfg.accum.steps
        raise ValueError(f"resume {str(run)!r}: its last launch trained on {world} processes (a torchrun of your own: its "
                         f"config.yaml says dist.nproc=1), and this one would go on on 1, its global batch from "
                         f"{per_rank * world} to {per_rank} samples per step: resume it as it was launched (the same "
                         f"torchrun command, {world} processes in all, with -m stabletrain train --resume {run}), or on "
                         f"this machine with dist.nproc={world}, or with dist.nproc=1 to go on on one process (resharded)")


def _same_task(base: dict, args: argparse.Namespace, resume: str) -> None:
    """Refuse a resume that names another task than the run trained (its task_args were checked against the new task's
    factory and the saved config.yaml blamed for them)."""
    given = [o.split("=", 1)[1] for o in args.overrides if o.startswith("task=")]
    if args.config and not given and Path(args.config).is_file():  # (a missing one: load_config's own line)
        loaded = load_yaml(Path(args.config).read_text(encoding="utf-8"), f"config file {args.config!r}")
        given = [loaded.get("task")] if isinstance(loaded, dict) else []
    trained = base.get("task") if isinstance(base, dict) else None
    if given and given[-1] and trained and given[-1] != trained:
        raise ValueError(f"config key 'task': {given[-1]!r}, but the run in {resume!r} trained {trained!r}: a resumed run "
                         f"keeps its task (its checkpoints hold that model); start a new run for {given[-1]!r}")


def cmd_train(args: argparse.Namespace) -> int:
    """``stabletrain train``: a SIGTERM after the fit is held until the command's last line is said (by ``cli.main``,
    which then puts the handler before back; called on its own, here)."""
    try:
        return _cmd_train(args)
    finally:
        if not getattr(args, "cli_says_last", False) and getattr(args, "late_sigterm", None) is not None:
            args.late_sigterm.restore()


def _cmd_train(args: argparse.Namespace) -> int:
    resume = _resume_target(args)
    if resume:
        other = [x.split("=", 1)[1] for x in args.overrides if x.startswith("run.dir=")]
        if other and Path(other[-1]).resolve() != Path(resume).resolve():
            raise ValueError(f"config key 'run.dir': {other[-1]!r}, but --resume {resume!r} continues the run in "
                             f"{resume!r}: drop run.dir= (or resume {other[-1]!r})")
        saved = Path(resume) / "config.yaml"
        if not saved.exists():
            if not Path(resume).exists():
                raise FileNotFoundError(f"resume {resume!r}: it does not exist (give a run directory: RUN_DIR)")
            if not Path(resume).is_dir():
                raise FileNotFoundError(f"resume {resume!r}: it is a file, not a run directory (give the run's folder)")
            run = Path(resume).parent.parent
            if Path(resume).parent.name == "checkpoints" and (run / "config.yaml").exists():
                raise FileNotFoundError(f"resume {resume!r}: it is a checkpoint of the run {str(run)!r}: resume the run "
                                        f"(stabletrain train --resume {run}), from its newest checkpoint that verifies")
            raise FileNotFoundError(f"resume {resume!r}: no config.yaml there; is it a stabletrain run directory?")
        source = f"config file {str(saved)!r}"
        base = load_yaml(saved.read_text(encoding="utf-8"), source) or {}
        _same_task(base, args, resume)
        cfg = load_config(args.config, [*args.overrides, f"resume={resume}", f"run.dir={resume}"], base=base,
                          base_source=source)
        run_dir = Path(resume)
        _same_world(cfg, run_dir, args.overrides)
    else:
        cfg = load_config(args.config, args.overrides)
        run_dir = Path(cfg.run.dir) if cfg.run.dir else None  # None: runs/<Task.name>-<timestamp>
    from ..distributed import launch as launcher  # no torch: a launcher or a supervisor does not hold it

    # The ranks, and every restart, must agree on the run directory: name it here, once.
    argv = list(getattr(args, "argv", None) or sys.argv[1:])
    if not resume and not cfg.run.dir:
        argv.append(f"run.dir={launcher.default_run_dir(cfg)}")
    if cfg.dist.nproc > 1 and not launcher.under_torchrun():
        cores = os.cpu_count() or 1
        if cfg.dist.nproc > cores and not Path("/proc/driver/nvidia").exists():  # (a trial's typo: 999 on 2 cores)
            console.warn(f"config key 'dist.nproc': {cfg.dist.nproc} processes on a machine with {cores} CPU core(s) and "
                         "no GPU: each imports torch (~300 MiB) and they share the cores; is that the number you meant?")
        if not resume and not cfg.run.overwrite and cfg.run.resume != "auto" and cfg.run.dir:  # once, not each rank's
            from ..records.rundir import RunDir

            RunDir.refuse_taken(Path(cfg.run.dir))
        console.say(f"starting {cfg.dist.nproc} processes on this machine (torchrun, {cfg.dist.strategy.upper()}): rank 0 "
                    "prints the progress and writes the run directory")
        return launcher.launch(cfg.dist.nproc, argv, max_restarts=cfg.run.max_restarts)
    if cfg.run.max_restarts and not launcher.restarted_by_parent():
        return launcher.supervise(argv, max_restarts=cfg.run.max_restarts)
    from ..distributed.group import process_group  # torch: only once the config is valid, in a process that trains
    from ..services.restarts import begin_launch

    with process_group(cfg.dist.backend, cfg.dist.timeout_s, cfg.dist.nproc) as ctx:
        launch = begin_launch(cfg, run_dir, bool(resume), ctx)  # run.resume=auto, and a restart's checks and record
        if launch.refused:
            return launcher.EXIT_GAVE_UP
        if launch.finished:
            return 0
        # Only a resubmission that run.resume=auto continued records its resume as one (`auto`: the crash-loop rule counts
        # it with the launches before), not a resume by hand (--resume) nor a restart's, whatever the config says
        cfg.run.resume = "auto" if launch.requeue else "never"
        token = launcher.BY_THE_CLI.set(True)  # (the lines that say how to resume give this command, not a script's)
        try:
            code = _train(args, cfg, launch.run_dir, launch.resume, ctx)
        finally:
            launcher.BY_THE_CLI.reset(token)
        if getattr(args, "late_sigterm", None) is not None:  # its lines said: a SIGTERM held ends it now, not after the
            args.late_sigterm.restore()  # process group's barrier (which a dead peer blocks for dist.timeout_s)
        return code


def _train(args: argparse.Namespace, cfg, run_dir: Path | None, resume: bool, ctx) -> int:
    from ..distributed.launch import EXIT_STALLED, resume_command
    from ..loop import Trainer
    from ..services.run_setup import DEFAULT_RUN_DIR
    from ..services.signals import LateSigterm

    trainer = Trainer(cfg, run_dir=run_dir if run_dir is not None else DEFAULT_RUN_DIR, resume=resume)
    run_dir = trainer.run.path if trainer.run is not None else run_dir
    args.late_sigterm = LateSigterm().install()  # (the loop's own handler stands while it trains; the CLI puts it back)
    try:
        record = trainer.fit()
    except KeyboardInterrupt:  # a second signal: out at once; say what is safe to resume from
        good = trainer.ckpt.latest_good() if trainer.ckpt is not None else None
        if ctx.is_main:
            where = (f"LAST_GOOD is {good.name}; resume with: {resume_command(run_dir)}" if good
                     else "no checkpoint was written")
            console.say(f"interrupted at step {trainer.step}; {where}", sys.stderr)
        return 130
    except (Exception, SystemExit) as err:
        if ctx.is_main and trainer.run is not None:  # the loop recorded a 'crash' event: say where to read it
            note = f"(recorded in {run_dir}; see: stabletrain report {run_dir})"
            if args.report:  # (the crashed run's report is where it helps most; one that fails says so, the crash stands)
                try:
                    write_report(run_dir)
                    note = f"(recorded in {run_dir}; its report: {run_dir / 'report.html'})"
                except Exception as failed:  # noqa: BLE001
                    console.warn(f"--report: the report of the crashed run failed ({type(failed).__name__}: {failed})")
            err.__notes__ = [*getattr(err, "__notes__", []), note]  # err.add_note(note), which Python 3.10 lacks
        raise
    # (a guard stop decided while a signal came in, during its capture, is the guard's: not a preemption to resume)
    signalled = trainer.signals.received is not None and str(trainer.stop_reason or "").startswith("stopped by")
    final = trainer.guard.final_stop if trainer.stop_reason is not None and not signalled else None
    stalled = final is not None  # (not restarted: it would meet the same stop again; the stall's exit code)
    if not ctx.is_main:
        return EXIT_STALLED if stalled else 1 if trainer.stop_reason is not None and not signalled else 0
    if trainer.stop_reason is not None and args.report:  # a stopped run's report too (a signal's, the guard's)
        write_report(run_dir)
    if trainer.stop_reason is not None and signalled:
        good = trainer.ckpt.latest_good() if trainer.ckpt is not None else None
        saved = ("checkpointed" if good is not None and good.name == f"step_{trainer.step:06d}" else
                 f"no checkpoint at step {trainer.step} (events.jsonl says why); LAST_GOOD is {good.name if good else 'none'}")
        console.say(f"{trainer.stop_reason}; {saved}. Resume with: {resume_command(run_dir)}")
        return 0
    if trainer.stop_reason is not None:
        when = ("at its last step" if trainer.step >= trainer.cfg.train.max_steps  # the stop came at the end's boundary
                else "early")
        captured = f" and {run_dir / 'incidents'}" if (run_dir / "incidents").is_dir() else ""
        console.say(f"the run stopped {when}: {trainer.stop_reason}. See {run_dir / 'events.jsonl'}{captured}"
                    + (f" (not restarted: {final})" if final and cfg.run.max_restarts else ""), sys.stderr)
        return EXIT_STALLED if stalled else 1
    if not trainer.history:  # resumed at or past train.max_steps: this launch trained nothing
        console.say(f"nothing to train: the run is at step {trainer.step} and train.max_steps={trainer.cfg.train.max_steps} "
                    f"(raise train.max_steps to train on); run directory: {run_dir}")
        if args.report:
            write_report(run_dir)
        return 0
    shown = ", ".join(f"{k}={record[k]:.4g}" for k in ("loss", "val_loss", "grad_norm") if isinstance(record.get(k), float))
    if record.get("num_spikes") and isinstance(record.get("loss_min"), float):  # the last interval's mean: a spike in it
        from ..report.text import plural

        said = f"loss={record['loss']:.4g}"
        shown = shown.replace(said, f"{said} (the last interval's mean, with {plural(int(record['num_spikes']), 'loss spike')}"
                              f" in it; its smallest {record['loss_min']:.4g})", 1)
    from ..report.health import health_summary, stall_figures
    from ..report.rundata import load_run

    run = load_run(run_dir) if (run_dir / "events.jsonl").is_file() else None
    skipped, undone = _skips(run) if run is not None else (sum(int(r.get("num_skipped", 0)) for r in trainer.history), 0)
    skipped_note = (f"{skipped} of {trainer.step} steps skipped ({share_text(skipped, trainer.step)}: see events.jsonl)"
                    if skipped else "no step skipped")
    if undone:
        skipped_note += (f" ({'and ' * bool(skipped)}{undone} before a rollback went back past "
                         f"{'it' if undone == 1 else 'them'}: trained again)")
    stall = stall_figures(run) if run is not None else None  # guard.on_stall=warn trained on through one
    if stall is not None and stall["recovered"] is None:
        skipped_note += (f"; stalled since step {stall['since']} (guard.on_stall=warn: trained on): at step {stall['step']}, "
                         f"{stall['gist']}")
    try:  # (the report's own verdicts; odd run data costs the note, never the run's success)
        figures = health_summary(run).figures if run is not None else {}
    except Exception:  # noqa: BLE001
        figures = {}
    # what the run went through to get here, as the report counts it (a rollback, a restart, a remedy applied live)
    remedies = sum(bool(e.extra.get("name")) for e in run.counted_events("remedy")) if run is not None else 0
    went = [f"{what} {'once' if n == 1 else f'{n} times'}" for what, n in (
        ("rolled back", len(figures.get("rollback_steps") or ())), ("restarted itself", figures.get("restarts") or 0)) if n]
    went += [f"applied {'a remedy' if remedies == 1 else f'{remedies} remedies'}"] if remedies else []
    if went:
        skipped_note += "; " + ", ".join(went) + " (events.jsonl)"
    rose = figures.get("loss_rose")
    if rose is not None:  # a run that got worse since its best (guard.on_spike=warn trains on through a divergence)
        skipped_note += (f"; the loss rose x{rose['factor']:.3g} from {rose['from']} ({rose['best']:.4g} at step "
                         f"{rose['best_step']}): stabletrain report {run_dir} says more")
    if skipped >= trainer.step > 0:  # not one update applied (a short fp16 run whose scale never found a finite step)
        from ..distributed.launch import EXIT_NO_UPDATE

        console.say(f"ran {trainer.step} steps and applied no update: every step was skipped ({skipped_note}); {shown}; "
                    f"run directory: {run_dir}", sys.stderr)
        if args.report:
            write_report(run_dir)
        return EXIT_NO_UPDATE  # (not restarted: it would skip them again)
    console.say(f"trained {trainer.step} step{'s' * (trainer.step != 1)}; {shown}; {skipped_note}; run directory: {run_dir}")
    loss = record.get("loss")
    if isinstance(loss, float) and not math.isfinite(loss):  # (it reads as trained: a trial's run at lr 3e38 exited 0)
        console.warn(f"the run ended with a non-finite loss ({loss}) in its last interval: its last steps were skipped or "
                     "its weights are no longer finite (events.jsonl; guard.on_nonfinite=remedy tries verified cures)")
    if args.report:
        write_report(run_dir)
    return 0


def _skips(run: RunData) -> tuple[int, int]:
    """(the run's skipped steps that still count, every launch's: none a resume or rollback went back past, as the
    report counts them; the skipped steps a rollback, or a remedy's, went back past: that stretch was trained again)."""
    counted = {e.step for e in run.counted_events("skip")}
    return len(counted), len({e.step for e in run.undone_events("skip")} - counted)


def write_report(run_dir: Path, out: str | None = None) -> None:
    from ..report import health_summary, load_run, write_report
    from ..report.goodput import read_goodput

    console.say(f"report written to {write_report(run_dir, out)}")
    run = load_run(run_dir)
    if run.problems:  # (listed on the page only: a console reader took the summary for whole)
        more = f" and {len(run.problems) - 1} more" if len(run.problems) > 1 else ""
        console.warn(f"the run's files have {len(run.problems)} unreadable part{'s' * (len(run.problems) > 1)}, left out "
                     f"of the summary: {run.problems[0]}{more} (the page lists them under 'Data problems')")
    print(health_summary(run).text)
    goodput = read_goodput(run_dir)
    if goodput is not None:
        note = goodput.short_note()  # (a 4 s run's "goodput 1.6%" alarmed: said why)
        print(goodput.line() + (f"; {goodput.total_s:.0f} s in all: {note[0].lower()}{note[1:-1]}" if note else ""))


def share_text(part: int, whole: int) -> str:
    """``part`` of ``whole`` in percent as the end line says it (:func:`~stabletrain.report.text.fmt_pct`: 1 of 300 is
    "0.3%", never "0%" for a step that was skipped)."""
    from ..report.text import fmt_pct

    return fmt_pct(part / max(whole, 1))

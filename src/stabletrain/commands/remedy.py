"""``stabletrain remedy INCIDENT_DIR``: replay a captured incident under candidate fixes; say which one cures it."""

from __future__ import annotations

import argparse
import json

__all__ = ["cmd_remedy", "add_remedy_parser"]

DESCRIPTION = """\
Replay RUN_DIR/incidents/step_N from its exact pre-step state under each candidate fix that fits its
failure class, and under the "just skip the step" baseline, over the incident's window and the K windows
after it (the same batches the run would see next). Each candidate gets a verdict with evidence:
  cures   the incident's window and all K after it finite, no spike by the guard's rule, and the end loss
          (mean of the last 5 steps after the incident's) no worse than the baseline's by more than 10% (where the baseline
          fails on a divergence: than the loss of the run's last interval before the growth began; for a loss spike,
          within 10% of the baseline's or of the run's level before the spike, the median its rule judged it against)
  fails   its first bad step (non-finite loss, grad norm or parameters, or a spike); a candidate that drops
          more than half of the samples, or has most of its steps skipped, only hides the symptom and fails
  worse   finite, but its end loss is more than 10% worse than that
  untestable  an adapter's spike captured alone (no step before it): a fix that changes updates cannot show
          an effect on its one step; a replay that drops every window it replays (nothing to judge)
Candidates: skip-step (the baseline), skip-samples, eps-guard (op), module-fp32 (overflow in a named module),
bf16 and scaler (overflow under fp16), lr-x0.5 and lr-x0.1 (every class), rollback-lr-x0.5, rollback-lr-x0.1 and
clip (divergence); for a loss spike: skip-samples (data), module-fp32 and the whole run in bf16 or fp32
(precision), update-clip and adam-eps for the named layer
(optimizer-state), lr-x0.5, lr-x0.1 (not for precision), and rollback-lr and clip (state, optimizer-state).
Writes remedy.json in the incident directory (replacing an earlier one; the run's own search, where it made one, is
kept in remedy.run.json). Time: about (K+1) x candidates
steps plus one load."""


def add_remedy_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("remedy", help="replay a captured incident under candidate fixes and say which one cures it",
                       formatter_class=argparse.RawDescriptionHelpFormatter, description=DESCRIPTION)
    p.add_argument("incident", metavar="INCIDENT_DIR", help="RUN_DIR/incidents/step_N (or RUN_DIR: its first incident, "
                   "the one the later ones follow from)")
    p.add_argument("--steps", type=int, default=20, metavar="K", help="windows replayed after the incident's (default: 20)")
    p.add_argument("--only", metavar="NAME,...", help="only these candidates (the baseline always runs), e.g. eps-guard,lr-x0.1")
    p.add_argument("--json", action="store_true", help="print remedy.json instead of the table")
    p.add_argument("--device", metavar="DEVICE", help="replay on this device (default: the run's)")


def cmd_remedy(args: argparse.Namespace) -> int:
    from ..records.bundles import RUN_REMEDY_FILE
    from ..remedy_search import format_table, search_remedies
    from . import incident_dir

    if args.steps < 1:  # (before the incident is chosen and said: a trial saw that line above the error)
        raise ValueError(f"--steps: expected an integer >= 1 (the windows replayed after the incident's), got {args.steps}")
    path = incident_dir(args.incident, newest=False, command="remedy")
    only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else None
    from ..tasks import TaskError

    try:
        record = search_remedies(path, steps=args.steps, only=only, device=args.device)
    except TaskError as err:  # an adapter's step this process cannot rebuild: every reason named, as diagnose does
        from ..records.bundles import DIAGNOSIS_FILE
        from .diagnose import replay_obstacles

        obstacles = replay_obstacles(path)
        if len(obstacles) < 2:
            raise
        kept = (f" (its {DIAGNOSIS_FILE}, written when it was captured, stays: `stabletrain diagnose` shows it)"
                if (path / DIAGNOSIS_FILE).is_file() else "")
        raise TaskError(f"incident {str(path)!r} cannot be replayed in a new process, so no remedy can be tried on it"
                        f"{kept}. Why not, and what to do:" + "".join(f"\n  - {o}" for o in obstacles)) from err
    if args.json:
        print(json.dumps(record, indent=2, default=str))
    else:
        print(format_table(record))
        kept = path / RUN_REMEDY_FILE
        print(f"written to {path / 'remedy.json'}" + (f" (the run's own search, made while it ran, is kept in {kept})"
                                                       if kept.is_file() else ""))
    return 0

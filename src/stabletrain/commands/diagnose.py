"""``stabletrain diagnose INCIDENT``: replay a captured incident in a new process and say where it broke.

An adapter's incident whose model or loss cannot be rebuilt here is not replayed: what stands in the way
is named (:func:`replay_obstacles`) and the diagnosis written when it was captured is shown instead.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .. import console
from ..errors import brief

__all__ = ["cmd_diagnose", "add_diagnose_parser", "replay_obstacles", "stored_diagnosis"]


def add_diagnose_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("diagnose",
                       help="replay a captured incident and name its cause: a NaN/Inf's op, module, parameter and "
                            "sample, a loss spike's class and evidence",
                       description="Replay RUN_DIR/incidents/step_N under the precise tools (a loss spike: under "
                                   "counterfactual replays); write diagnosis.json next to it, or diagnosis.replayed.json "
                                   "where the capture's diagnosis.json is there (it stays the record).")
    p.add_argument("incident", metavar="INCIDENT_DIR", help="RUN_DIR/incidents/step_N (or RUN_DIR: its newest incident)")
    p.add_argument("--json", action="store_true", help="print the whole diagnosis as JSON")
    p.add_argument("--device", metavar="DEVICE", help="replay on this device (default: the run's)")
    p.add_argument("--no-bisect", action="store_true", help="skip the bisection over the batch's samples")


def cmd_diagnose(args: argparse.Namespace) -> int:
    import json

    from ..incident_replay import diagnose_incident
    from ..records.bundles import DIAGNOSIS_FILE, REPLAYED_FILE
    from ..records.jsonl import json_safe
    from . import incident_dir

    path = incident_dir(args.incident, newest=True, command="diagnose")
    captured = _read_json(path / DIAGNOSIS_FILE)  # the capture's diagnosis: the record, never overwritten here
    out = REPLAYED_FILE if captured is not None else DIAGNOSIS_FILE
    try:
        result = diagnose_incident(path, device=args.device, bisect=not args.no_bisect, out=out)
    except Exception:
        obstacles = replay_obstacles(path)
        if not obstacles:
            raise
        result = stored_diagnosis(path, obstacles)
        replayed = False
    else:
        replayed = True
    if args.json:
        print(json.dumps(json_safe(result), indent=2, allow_nan=False))  # strict JSON, as diagnosis.json (jq reads it)
        return 0
    on = result.get("sample_ranks") or {}  # (a bundle of every rank's window: its named samples' ranks)
    where = (f"rank {result['rank']}" if result.get("rank") is not None else "every rank's batch: " + "; ".join(
        f"sample {i} on rank {r}" for i, r in on.items()) if on else "every rank's batch")
    print(f"incident: {path} (step {result['step']}, {where})")
    for key in ("summary", "failure_class", "evidence", "stage", "op", "direction", "module", "origin", "first_nonfinite_param",
                "nonfinite_params_after_update", "bad_samples", "reproduces"):
        if result.get(key) not in (None, [], "") and not (key == "stage" and result.get("anomaly") == "spike"):
            print(f"  {_LABELS.get(key, key):<30} {result[key]}")  # (a finite spike has no non-finite stage: no "none")
    stack = (result.get("first_op") or {}).get("stack")
    if stack:
        print("  where the first non-finite op ran:")
        print("    " + "\n    ".join(stack.rstrip().splitlines()[-6:]))
    anomaly = [line for line in str(result.get("anomaly_trace") or "").splitlines() if line.startswith("anomaly mode")]
    if anomaly:
        print(f"  replay under detect_anomaly: {anomaly[0].removeprefix('anomaly mode: ')}")
    if replayed:
        print(f"  written to {path / out}" + (f" (the capture's {DIAGNOSIS_FILE} is kept)" if captured is not None else ""))
        then, now = (captured or {}).get("failure_class"), result.get("failure_class")
        if captured is not None and then is not None and then != now:
            console.warn(f"this replay in a new process says {now!r}, the diagnosis written when the incident was "
                         f"captured says {then!r} ({DIAGNOSIS_FILE}: {captured.get('summary')}): the model or loss rebuilt "
                         "here may not be the one that trained (a hook or a change made after the model was built)")
    return 0


# diagnosis.json's key names the parameter whose gradient went non-finite first (the parameters themselves may be finite)
_LABELS = {"first_nonfinite_param": "first non-finite gradient"}


def _read_json(path: Path) -> dict | None:
    """The JSON object in ``path``, or None when there is none (no file, or not a whole JSON object)."""
    import json

    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def replay_obstacles(incident: Path) -> list[str]:
    """Say why an adapter's captured step cannot be rebuilt in this process: a phrase per part (model, loss), or [].

    Only an adapter's incident (task ``captured_task``) holds recipes that may not rebuild; each part is
    tried on its own so that every obstacle is named (a built-in run's incident has none: []).
    """
    import torch

    from ..records.bundles import load_bundle
    from ..records.captured import REBUILD_HINT, TASK_SPECS, loss_from_recipe, model_from_recipe

    try:
        config = load_bundle(incident).get("config") or {}
    except Exception:  # the replay's own error says what is wrong with the bundle
        return []
    if config.get("task") not in TASK_SPECS:
        return []
    args = config.get("task_args") or {}
    host, _, cls = str(args.get("name") or "").rpartition(":")
    found = []
    model, loss = args.get("model"), args.get("loss")
    if model is None:
        fix = REBUILD_HINT.get(host, REBUILD_HINT["monitor"])
        if cls and isinstance(getattr(torch.nn, cls, None), type):
            found.append(f"the model is a torch.nn.{cls}, whose layers are not recorded (a model is rebuilt from its "
                         f"class only when that class builds it with no arguments): {fix}")
        else:
            found.append(f"the model's class{f' {cls}' if cls else ''} cannot be imported in a new process (defined in "
                         f"__main__ or inside a function) or needs constructor arguments: {fix}")
    elif model.get("kind") == "none":  # the reason was recorded at capture (a model_factory in __main__)
        found.append(model["why"])
    else:
        try:
            model_from_recipe(model, host)
        except Exception as err:
            what = model.get("class") or model.get("factory") or model.get("kind")
            found.append(f"the model ({what}) could not be rebuilt: {type(err).__name__}: {brief(str(err))}")
    if loss is None and host == "transformers":
        found.append("the trainer computes its loss its own way (a compute_loss override, label smoothing or "
                     "compute_loss_func), which only the training process can replay: pass a module-level loss_fn "
                     "to StableTrainCallback to replay it here")
    elif loss is None:
        found.append("the loss function cannot be imported in a new process (a lambda, or defined in __main__ or inside "
                     "a function): pass a loss_fn defined at the top of an importable module")
    else:
        try:
            loss_from_recipe(loss)
        except Exception as err:
            found.append(f"the loss ({loss.get('function') or loss.get('kind')}) could not be rebuilt: "
                         f"{type(err).__name__}: {brief(str(err))}")
    return found


def stored_diagnosis(incident: Path, obstacles: list[str]) -> dict:
    """Return the diagnosis.json written when ``incident`` was captured, after saying why it is not replayed again."""
    import json

    from ..records.bundles import DIAGNOSIS_FILE
    from ..records.jsonl import revive
    from ..tasks import TaskError  # torch: not at import, where the parser is built

    stored = incident / DIAGNOSIS_FILE
    why = "; ".join(obstacles)
    if not stored.is_file():
        raise TaskError(f"incident {str(incident)!r} cannot be replayed in a new process ({why}), and no "
                        f"{DIAGNOSIS_FILE} was written when it was captured")
    console.warn(f"incident {str(incident)!r} cannot be replayed in a new process; showing {stored.name}, written "
                 "when it was captured. Why not, and what to do:")
    for obstacle in obstacles:  # one line each (they were one 700-character line)
        console.write_line(f"  - {obstacle}", sys.stderr)
    return revive(json.loads(stored.read_text(encoding="utf-8")))

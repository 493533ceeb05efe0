"""Incident bundles: what replaying one bad step needs, on disk, and the diagnosis that reads them.

``RUN_DIR/incidents/step_N/``::

    bundle.pt        the step number and rank, the resolved config, the window's dataset indices
                     (epoch, position, micro-batches), the RNG states at the start of the step, the
                     model / optimizer / schedule / precision state live before the step, and what the
                     run observed (loss, grad norm, whether the bad value appeared after the update)
    diagnosis.json   written by :func:`stabletrain.incident_replay.diagnose_incident` (``stabletrain diagnose``)
    remedy.json      written by :func:`stabletrain.remedy_search.search_remedies` (``stabletrain remedy``)
    rank_R/          DDP and FSDP: the bundle of another rank that saw the same bad step
    dcp/             FSDP: the model and optimizer state, each rank's shards written with
                     ``torch.distributed.checkpoint`` (the bundles hold markers pointing here)

Under DDP and FSDP the bundle is that of the rank whose own loss, inputs or gradients were non-finite
(its ``rank``, its window of its data shard, its RNG state), so the diagnosis replays on that rank's
batch. :func:`load_bundle` returns the full model and optimizer state, in the one-process format,
whatever the strategy: under DDP rank 0 writes them into the bundle; under FSDP every rank writes its
own shards into ``dcp/`` (no rank gathers the whole model while training waits) and loading reads
them whole (:func:`stabletrain.records.checkpoint.shards.to_full_state`), so the diagnosis replays on one
process, with every parameter under its original name. Rank 0 writes the rest.

The bundle holds only tensors and plain values: it loads with ``torch.load(weights_only=True)``.
The batches are re-collated from the dataset indices, so a user's collate output need not pickle.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Any

import torch

from ..fileio import atomic_write
from .checkpoint.shards import is_dcp_entry, to_full_state

__all__ = ["write_bundle", "load_bundle", "incident_order", "set_aside_incidents", "sample_ranks", "with_sample_ranks",
           "BUNDLE_FILE", "BUNDLE_DCP_DIR", "DIAGNOSIS_FILE", "REMEDY_FILE", "RUN_REMEDY_FILE", "STATE_IN", "REPLAYED_FILE"]

BUNDLE_FILE = "bundle.pt"
BUNDLE_DCP_DIR = "dcp"
DIAGNOSIS_FILE = "diagnosis.json"
#: ``stabletrain diagnose`` on an incident that has its capture's diagnosis.json writes its replay here: the
#: capture's stays the record (an adapter's model rebuilt in a new process may not be the one that trained).
REPLAYED_FILE = "diagnosis.replayed.json"
REMEDY_FILE = "remedy.json"
#: The search a run made itself (``guard.on_nonfinite/on_spike=remedy``), kept here when ``stabletrain remedy`` searches
#: the incident again (its remedy.json is then the new search's): what the run applied stays on the record.
RUN_REMEDY_FILE = "remedy.run.json"
#: A bundle whose model and optimizer are another bundle's (a DDP incident's later ranks, ``rank_R/``: every rank
#: holds the same ones) names that bundle's directory, relative to its own, under this key instead of holding them.
STATE_IN = "model_and_optimizer_in"


def incident_order(folder: Path) -> tuple[int, int, bool, str]:
    """Sort key of ``RUN_DIR/incidents`` folders: ``step_N`` and ``step_N.k`` (the run's k-th capture of step N) by
    step and capture, numerically (``.10`` after ``.9``), one a restart set aside (``.superseded-R``) after its own."""
    parts = folder.name.removeprefix("step_").split(".")
    step = int(parts[0]) if parts[0].isdigit() else -1
    k = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 1
    return (step, k, ".superseded-" in folder.name, folder.name)


def set_aside_incidents(run_dir: Path, after: int, label: str, keep: str | None = None) -> list[str]:
    """Rename the incidents of the steps after ``after`` (a restart or a resume trains them again, and may capture them
    again) to ``step_N[.k].superseded-LABEL`` (``-LABEL.2`` ... where that name is taken): kept, never overwritten nor
    read as the run's own. One set aside before stays as it is, and so does ``keep`` (``remedy.apply``'s
    ``INCIDENT_DIR:NAME``: the resume applies its remedy). Returns the new names."""
    kept, held = [], Path(keep.rpartition(":")[0]).resolve() if keep else None
    for folder in sorted((Path(run_dir) / "incidents").glob("step_*")):
        step, _, aside, _ = incident_order(folder)  # step_N, or step_N.k (its k-th capture in the run)
        if folder.is_dir() and not aside and step > after and folder.resolve() != held:
            target, n = folder.with_name(f"{folder.name}.superseded-{label}"), 1
            while target.exists():
                n += 1
                target = folder.with_name(f"{folder.name}.superseded-{label}.{n}")
            os.replace(folder, target)
            kept.append(target.name)
    return kept


def write_bundle(directory: Path, bundle: dict[str, Any]) -> Path:
    """Write ``bundle`` to ``directory/bundle.pt`` atomically (temporary name, fsync, rename)."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / BUNDLE_FILE
    atomic_write(final, lambda fh: torch.save(bundle, fh))
    return final


def load_bundle(directory: str | Path) -> dict[str, Any]:
    """Load an incident bundle safely (``weights_only=True``); raise FileNotFoundError/ValueError clearly.

    An FSDP bundle's model and optimizer are read whole from its ``dcp/`` shards (every rank's, in this
    process), a bundle that names another's (:data:`STATE_IN`) from that one: the result has the same keys
    and formats as any other bundle.
    """
    path = Path(directory) / BUNDLE_FILE
    if not path.exists():
        given = Path(directory)
        hint = (f"that is the bundle itself: give its incident folder, {str(given.parent)!r}"
                if given.name == BUNDLE_FILE and given.is_file() else "expected RUN_DIR/incidents/step_N")
        raise FileNotFoundError(f"incident {str(directory)!r}: no {BUNDLE_FILE} there; {hint}")
    try:
        bundle = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # unpickling errors have many types; report them as one clear line
        if not zipfile.is_zipfile(path):  # (torch's own first line then advised weights_only=False: unsafe, and no help)
            raise ValueError(f"incident bundle {str(path)!r} is not a readable torch file ({path.stat().st_size} bytes: "
                             "corrupt or truncated?)") from None
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        detail = next((line for line in lines if "WeightsUnpickler error" in line or "Unsupported global" in line), lines[0]
                      if lines else type(err).__name__)
        raise ValueError(f"incident bundle {str(path)!r} cannot be loaded safely: {detail}") from None
    if STATE_IN in bundle:
        first = load_bundle(Path(directory) / bundle.pop(STATE_IN))
        bundle["model"], bundle["optimizer"] = first["model"], first["optimizer"]
    if not is_dcp_entry(bundle.get("model")):
        return bundle
    folder = (Path(directory) / bundle.get("dcp_dir", BUNDLE_DCP_DIR)).resolve()
    if not (folder / ".metadata").is_file():
        raise ValueError(f"incident bundle {str(path)!r}: its model and optimizer shards are missing ({folder}/.metadata "
                         "not found); the dcp/ folder beside bundle.pt holds them")
    for key in ("model", "optimizer"):
        if is_dcp_entry(bundle.get(key)):
            bundle[key]["path"] = str(folder)
    return to_full_state(bundle)


def sample_ranks(window: dict[str, Any], diagnosis: dict[str, Any]) -> dict[int, int]:
    """The rank each sample a diagnosis named (``bad_samples``, dataset indices) was on, in a :func:`global_record`'s
    window."""
    on = {i: r for idx, r in zip(window["indices"], window["ranks"]) for i in idx}
    return {int(i): on[int(i)] for i in diagnosis.get("bad_samples") or [] if int(i) in on}


def with_sample_ranks(result: dict[str, Any], bundle: dict[str, Any]) -> dict[str, Any]:
    """A diagnosis of a bundle holding every rank's window (``window["ranks"]``): its ``rank`` the one rank its named
    samples were on (None: several, or none named), and ``sample_ranks`` each one's. Another bundle's: as it is."""
    if "ranks" in bundle["window"]:
        on = sample_ranks(bundle["window"], result)
        result["sample_ranks"] = {str(i): r for i, r in on.items()}
        result["rank"] = next(iter(set(on.values()))) if len(set(on.values())) == 1 else None
    return result


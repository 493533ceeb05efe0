"""Per-step training figures kept on the device and reduced on the host once per log interval.

Each step writes a handful of scalars into preallocated device buffers (one row per step of the
interval). :meth:`StepMetrics.reduce` does the interval's single host-device sync and returns plain
Python numbers: the interval summary plus every step's row, so events carry exact step numbers.

Keys of the summary (one line of ``metrics.jsonl``):

=====================  ==========================================================================
step                   last optimizer step of the interval (1-based count of steps taken)
loss, loss_min,        mean / min / max over the interval's finite steps of each step's unscaled per-item loss
loss_max, loss_steps   (loss_steps: how many steps those are)
grad_norm,             mean / max of the pre-clip global grad norm over finite steps
grad_norm_max
grad_norm_post_clip    mean post-clip norm over finite steps
clip_rate              fraction of the applied steps where clipping fired
lr                     learning rate after the interval's last step
loss_scale             GradScaler scale (1.0 without a scaler)
num_skipped            steps whose update was skipped in the interval (non-finite, overflow, spike)
num_nonfinite          steps with a non-finite loss or grad norm, or whose parameter check failed (an fp16
                       overflow the GradScaler backs off from is a skip, not counted here)
num_spikes             loss spikes in the interval (rule: stabletrain.policies.guard)
update_norm,           ||theta_t - theta_(t-1)|| of the interval's last step, and its ratio to ||theta_(t-1)||
update_ratio           (measured on that step only: one parameter copy per interval)
num_incidents,         intervals with an incident (non-finite steps or spikes) and rollbacks so far (the loop adds them)
num_rollbacks
tokens_per_s,          throughput over the interval's wall time (tokens = items the loss counts)
samples_per_s
step_time_s            mean wall time per optimizer step
peak_memory_mib        CUDA max allocated, or the process's peak RSS on CPU
epoch, samples_seen,   data progress at the end of the interval
tokens_seen
top_grad_layers        the parameters with the largest share of the squared grad norm
top_update_layers      the parameters with the largest update/weight ratio at the interval's last step
world_size             processes training together (DDP runs only); every figure above is global
=====================  ==========================================================================

Under DDP every column is already global when it is recorded (the window's loss and count are
all-reduced once per step, the grad norm is that of the all-reduced gradients, the sample count comes
from the global data order), so the interval needs one collective only: an all-gather of each
rank's per-step "this rank saw a non-finite value" flag (and its pending signal), folded into the
interval's one sync. Rows then carry ``ranks``: who saw it.

Per parameter, the interval also keeps the squared grad norms summed over its finite steps and, from the
step that measured the update (``param_update_norms``, ``param_norms``: the interval's last), each
parameter's update and weight norm: read in the same sync, they reach the summary as ``interval_*`` lists
(the precursor's figures, :mod:`stabletrain.policies.precursor`) and the record as ``top_update_layers``.
"""

from __future__ import annotations

import math
import operator
import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..numerics import applied_only, is_constant

__all__ = ["StepMetrics", "peak_memory_mib", "interval_record", "update_ratios", "host_figures", "COLUMNS"]

# Per-step buffer columns, in order.
COLUMNS = ("loss", "grad_norm", "post_clip_norm", "clipped", "applied", "finite", "spike", "params_finite", "lr",
           "loss_scale", "count", "update_norm", "update_ratio", "overflow")

#: Columns whose values are live state the run updates in place (the lr tensor, the scaler's scale): cloned.
_LIVE = tuple(COLUMNS.index(c) for c in ("lr", "loss_scale"))
_FINITE = COLUMNS.index("finite")
_DTYPE = operator.attrgetter("dtype")  # a C-level read, for map()

#: Columns a step may leave out, and their values then (the update norm is measured on some steps only; the
#: parameters are checked on some steps only: NaN = not checked on that step).
DEFAULTS = {"spike": 0.0, "params_finite": float("nan"), "overflow": 0.0, "update_norm": float("nan"),
            "update_ratio": float("nan")}
_MISSING = object()  # a required column's "default": update() names it
_SPEC = tuple((c, DEFAULTS.get(c, _MISSING)) for c in COLUMNS)
#: A measured update's figures, not measured (NaN) where its step was skipped (:func:`~stabletrain.numerics.applied_only`).
_UPDATE = ("update_norm", "update_ratio", "param_update_norms")


def peak_memory_mib(device: torch.device) -> float:
    """Return the peak memory in MiB: CUDA max allocated on a GPU, else the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux


@dataclass
class _Row:
    step: int
    values: dict[str, float]
    ranks: list[int] = field(default_factory=list)  # DDP: the ranks whose own values were non-finite


class StepMetrics:
    """Device-side accumulators for one log interval of at most ``capacity`` steps.

    ``dist``: a :class:`~stabletrain.distributed.group.DistContext`; with more than one rank each rank also
    records its local non-finite flag per step, gathered by :meth:`reduce`. ``local``: under DDP, the
    columns that hold this rank's own value (an adapter's host computes each rank's loss and count on its
    own): gathered in the same all-gather, a row's ``loss`` becomes the mean over the ranks (NaN if any
    rank's is) and its ``count``, like the interval's samples, the sum.

    The state holds the interval's recorded steps, not the buffer: it loads into an interval of another
    length (``log.every`` changed on resume). An interval that starts with ``n`` loaded steps holds up to
    ``n + interval`` until its reduce (the next boundary may be a whole new interval away).
    """

    def __init__(self, capacity: int, num_params: int, device: torch.device, dist: Any = None,
                 local: tuple[str, ...] = ()) -> None:
        self.interval, self.device = capacity, device
        self.param_sq = torch.zeros(num_params, dtype=torch.float32, device=device)
        self.steps: list[int] = []
        self.samples = 0
        self.dist = dist if dist is not None and dist.world > 1 else None
        assert set(local) <= {"loss", "count"}, f"StepMetrics: local columns are loss and count, got {local}"
        self.local = tuple(COLUMNS.index(c) for c in local) if self.dist is not None else ()
        self._allocate(capacity)
        # Steps recorded but not yet written into the buffers: (row values, per-param norms, finite, local flag).
        self._pending: list[tuple[list[Any], Tensor, Any, Tensor | None]] = []
        self._layouts: dict[tuple[Any, ...], Tensor] = {}  # _flush's index per layout of dtypes and places
        # The interval's measured update, per parameter: (update norms, weight norms), 1-D device tensors, or None.
        self._update: tuple[Tensor, Tensor] | None = None

    def _allocate(self, capacity: int) -> None:
        """(Re)make the per-step buffers with room for ``capacity`` steps (zeros; nothing recorded is kept)."""
        self.capacity = capacity
        self.buf = torch.zeros(capacity, len(COLUMNS), dtype=torch.float32, device=self.device)
        self.local_flags = torch.zeros(capacity + 1, device=self.device) if self.dist is not None else None

    def update(self, step: int, *, per_param_norms: Tensor, num_samples: int, local_nonfinite: Tensor | None = None,
               **values: Tensor | float) -> None:
        """Record one step (no sync; the device work is batched per interval, see :meth:`_flush`).

        ``values`` holds one 0-dim tensor (or number) per name in :data:`COLUMNS` (those in :data:`DEFAULTS`
        may be left out); other keys of a step's output are ignored. The tensors are kept, not copied
        (``lr`` and ``loss_scale``, live state the run updates in place, are cloned): a step's outputs are
        fresh tensors. ``num_samples``: the step's samples over all ranks. ``param_update_norms`` and
        ``param_norms`` (1-D, one value per parameter), on a step that measured its update: kept for the reduce.
        ``local_nonfinite`` (DDP): whether this rank's own loss or inputs were non-finite (a rank whose gradients
        alone were is named by the incident capture).
        """
        assert len(self.steps) < self.capacity, "StepMetrics.reduce() must be called every `capacity` steps"
        if "param_update_norms" in values and "applied" in values:  # a skipped step made no update: its 0 read as a
            values = {**values, **applied_only({k: values[k] for k in _UPDATE if k in values}, values["applied"])}  # freeze
        get = values.get
        row = [get(c, d) for c, d in _SPEC]  # (per step, in Python: the fewer calls the better)
        assert id(_MISSING) not in map(id, row), \
            f"StepMetrics.update: missing {[c for c, v in zip(COLUMNS, row) if v is _MISSING]}"
        for c in _LIVE:
            v = row[c]
            if isinstance(v, Tensor) and not is_constant(v):
                row[c] = v.detach().clone()
        self._pending.append((row, per_param_norms, values["finite"], local_nonfinite))
        if "param_update_norms" in values:
            self._update = (values["param_update_norms"], values["param_norms"])  # type: ignore[assignment]
        self.steps.append(step)
        self.samples += num_samples

    def _flush(self) -> None:
        """Write the pending steps into the buffers, column by column in a few ops for the whole interval.

        A stack costs about half a microsecond per input on CPU (four times that across dtypes), an op on one
        value a few, and Python per value about as much: so the columns are sorted by kind with C-level
        checks (``map``, ``set``), the tensors of each dtype are stacked together (made float32), and they
        land with one ``index_copy_`` at their places (an index cached per layout: the same every interval of
        a run). Numbers are one fill per column (a column's default, e.g. the update norm's NaN on the steps
        that did not measure it), before the copy. Per-parameter norms: one stack and one masked sum.
        """
        pending, self._pending = self._pending, []
        if not pending:
            return
        n0, k = len(self.steps) - len(pending), len(pending)
        block = self.buf[n0:n0 + k]
        with torch.no_grad():
            try:
                self._write_block(block, n0, [r for r, _, _, _ in pending])
            except RuntimeError:  # a tensor of another shape or device (an adapter's): value by value
                for j, (row, _, _, _) in enumerate(pending):
                    for c, v in enumerate(row):
                        if isinstance(v, Tensor):
                            block[j, c].copy_(v.detach().reshape(()))
                        else:
                            block[j, c].fill_(float(v))
            finite = block[:, _FINITE:_FINITE + 1] > 0.5  # the finite column, as written above
            norms = torch.stack([p for _, p, _, _ in pending])
            self.param_sq += torch.where(finite, norms.float() ** 2, 0.0).sum(0)
            flags = [(j, f) for j, (_, _, _, f) in enumerate(pending) if f is not None]
            if self.local_flags is not None and flags:
                if len(flags) == k:
                    self.local_flags[n0:n0 + k].copy_(torch.stack([f.reshape(()) for _, f in flags]))
                else:
                    for j, f in flags:
                        self.local_flags[n0 + j].copy_(f.reshape(()))

    def _write_block(self, block: Tensor, n0: int, rows: list[list[Any]]) -> None:
        """:meth:`_flush`'s fast path: ``rows`` (values of 0-dim tensors on the device, or numbers) into ``block``."""
        k, width = len(rows), len(COLUMNS)
        stacked: dict[torch.dtype, tuple[list[Any], list[Tensor]]] = {}  # dtype -> (places, tensors)
        for c, col in enumerate(zip(*rows)):
            kinds = set(map(type, col))
            if kinds == {Tensor} and len(dtypes := set(map(_DTYPE, col))) == 1:  # the common case
                places, values = stacked.setdefault(dtypes.pop(), ([], []))
                places.append(c)
                values.extend(col)
                continue
            numbers = [float(v) for v in col if not isinstance(v, Tensor)]
            if numbers:
                if len(set(map(repr, numbers))) == 1:
                    block[:, c].fill_(numbers[0])
                else:
                    for j, v in enumerate(col):
                        if not isinstance(v, Tensor):
                            block[j, c].fill_(float(v))
            for j, v in enumerate(col):  # the few tensors of a mixed column (the interval's last step's)
                if isinstance(v, Tensor):
                    places, values = stacked.setdefault(v.dtype, ([], []))
                    places.append((j, c))
                    values.append(v)
        if not stacked:
            return
        layout = (n0, k, tuple((dtype, tuple(places)) for dtype, (places, _) in stacked.items()))
        index = self._layouts.get(layout)
        if index is None:
            if len(self._layouts) >= 16:
                self._layouts.clear()
            flat: list[int] = []
            for _, places in layout[2]:
                for place in places:  # a whole column (its k steps), or one step's cell
                    flat.extend([(n0 + j) * width + place for j in range(k)] if isinstance(place, int)
                                else [(n0 + place[0]) * width + place[1]])
            index = self._layouts[layout] = torch.tensor(flat, dtype=torch.long, device=self.device)
        stacks = [torch.stack(values).to(torch.float32) for _, values in stacked.values()]
        self.buf.view(-1).index_copy_(0, index, stacks[0] if len(stacks) == 1 else torch.cat(stacks))

    def __len__(self) -> int:
        return len(self.steps)

    def reduce(self, signal: int = 0, annotate: Callable[[list[_Row]], None] | None = None,
               ) -> tuple[dict[str, Any], list[_Row], list[float]]:
        """Return (summary, per-step rows, per-parameter squared-norm sums) and reset. ONE host sync.

        ``annotate``: fills in row values decided on the host before the summary is made (the guard's
        spike rule, :meth:`stabletrain.policies.guard.Guard.mark_spikes`).

        Under DDP also one all-gather (every rank must call this at the same step): each row's
        ``ranks`` and the summary's ``interval_signal`` (the largest ``signal`` any rank passed) come from it.
        """
        n = len(self.steps)
        if n == 0:
            return {}, [], []
        self._flush()
        p = len(self.param_sq)
        parts = [self.buf[:n].flatten(), self.param_sq]
        if self._update is not None:
            parts += [u.detach().reshape(-1).to(self.device, torch.float32) for u in self._update]
        if self.local_flags is not None:
            self.local_flags[self.capacity] = float(signal)
            mine = [self.local_flags, *(self.buf[:, c] for c in self.local),
                    *([torch.full((1,), float(self.samples), device=self.device)] if self.local else [])]
            parts.append(self.dist.all_gather(torch.cat(mine)).flatten())
        host = torch.cat(parts).tolist()  # the interval's one sync
        table = [host[r * len(COLUMNS):(r + 1) * len(COLUMNS)] for r in range(n)]
        param_sq = host[n * len(COLUMNS):n * len(COLUMNS) + p]
        at = n * len(COLUMNS) + p  # then the measured update's per-parameter norms, when the interval has them
        param_update, param_norms = (host[at:at + p], host[at + p:at + 2 * p]) if self._update is not None else ([], [])
        if self._update is not None:
            at += 2 * p
        rows = [_Row(step, dict(zip(COLUMNS, vals))) for step, vals in zip(self.steps, table)]
        interval_signal = signal
        if self.local_flags is not None:
            flags = host[at:]
            width = self.capacity + 1 + len(self.local) * self.capacity + (1 if self.local else 0)
            per_rank = [flags[r * width:(r + 1) * width] for r in range(self.dist.world)]
            for i, row in enumerate(rows):
                row.ranks = [r for r in range(self.dist.world) if per_rank[r][i] > 0.5]
            interval_signal = int(max(f[self.capacity] for f in per_rank))
            for j, c in enumerate(self.local):  # each rank's own values: the mean loss, the total count
                at = self.capacity + 1 + j * self.capacity
                for i, row in enumerate(rows):
                    values = [f[at + i] for f in per_rank]
                    row.values[COLUMNS[c]] = sum(values) / (len(values) if COLUMNS[c] == "loss" else 1)
            if self.local:
                self.samples = int(sum(f[-1] for f in per_rank))
        if annotate is not None:
            annotate(rows)
        finite_rows = [r.values for r in rows if r.values["finite"] > 0.5]
        # The interval's loss is over its finite steps: one NaN step must not turn the whole line into NaN
        # (num_nonfinite says how many there were).
        losses = [r.values["loss"] for r in rows if math.isfinite(r.values["loss"])]
        # The last measured update's row: the last with one (a row that measured none holds NaN), unless the last step that
        # measured it was skipped (NaN too, its per-parameter norms with it): then none, not an earlier step's in its place
        last_skipped = bool(param_update) and all(math.isnan(x) for x in param_update)
        updates = [] if last_skipped else [r.values for r in rows if not math.isnan(r.values["update_norm"])]
        summary: dict[str, Any] = {
            "step": self.steps[-1],
            "loss": sum(losses) / len(losses) if losses else float("nan"),
            "loss_min": min(losses, default=float("nan")),
            "loss_max": max(losses, default=float("nan")),
            "loss_steps": len(losses),
            "grad_norm": (sum(r["grad_norm"] for r in finite_rows) / len(finite_rows)) if finite_rows else float("nan"),
            "grad_norm_max": max((r["grad_norm"] for r in finite_rows), default=float("nan")),
            "grad_norm_post_clip": ((sum(r["post_clip_norm"] for r in finite_rows) / len(finite_rows)) if finite_rows
                                    else float("nan")),
            # over the applied steps: a skipped step's gradients were discarded, clipped or not (a skipped spike step
            # counted, and made a clip rate of 11% out of one step)
            "clip_rate": (sum(r.values["clipped"] for r in rows if r.values["applied"] >= 0.5)
                          / max(sum(1 for r in rows if r.values["applied"] >= 0.5), 1)),
            "lr": rows[-1].values["lr"],
            "loss_scale": rows[-1].values["loss_scale"],
            "num_skipped": int(sum(1 for r in rows if r.values["applied"] < 0.5)),
            "num_nonfinite": int(sum(1 for r in rows if (r.values["finite"] < 0.5 and r.values["overflow"] < 0.5)
                                     or r.values["params_finite"] < 0.5)),
            "num_spikes": int(sum(1 for r in rows if r.values["spike"] > 0.5)),
            "update_norm": updates[-1]["update_norm"] if updates else float("nan"),
            "update_ratio": updates[-1]["update_ratio"] if updates else float("nan"),
            "interval_tokens": sum(r.values["count"] for r in rows),
            "interval_samples": self.samples,
            "interval_steps": n,
            "interval_signal": interval_signal,
            "interval_finite_steps": len(finite_rows),
            "interval_param_update_norms": param_update,
            "interval_param_norms": param_norms,
        }
        self.clear()
        return summary, rows, param_sq

    def clear(self) -> None:
        """Drop the interval's recorded steps without reducing them (no sync); the next interval starts empty."""
        self._pending = []
        self._update = None
        self.steps, self.samples = [], 0
        if self.capacity != self.interval:  # the interval that began with a loaded partial one is over
            self._allocate(self.interval)
        elif self.local_flags is not None:
            self.local_flags.zero_()
        # (buf is not zeroed: every row a reduce or state_dict reads was written by its step's flush)
        self.param_sq.zero_()

    def state_dict(self) -> dict[str, Any]:
        """The interval so far: its recorded steps' rows (``buf``, one per step), ``param_sq``, steps, samples and
        the measured update's per-parameter norms (``param_update``: a 2 x params tensor, or None)."""
        self._flush()
        n = len(self.steps)
        update = torch.stack([u.detach().float() for u in self._update]) if self._update is not None else None
        return {"buf": self.buf[:n].clone(), "param_sq": self.param_sq.clone(), "steps": list(self.steps),
                "samples": self.samples, "param_update": update}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` under any interval length (a state saved with the whole buffer loads too)."""
        steps = list(state["steps"])
        self._allocate(len(steps) + self.interval if steps else self.interval)
        self.buf[:len(steps)].copy_(state["buf"][:len(steps)])
        self.param_sq.copy_(state["param_sq"])
        self.steps, self.samples = steps, int(state["samples"])
        self._pending = []
        update = state.get("param_update")  # absent from a state saved before it was kept
        self._update = (update[0].to(self.device), update[1].to(self.device)) if update is not None else None


def interval_record(summary: dict[str, Any], param_sq: list[float], names: list[str], elapsed_s: float, *,
                    top_layers: int, progress: dict[str, Any], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Build one ``metrics.jsonl`` line from :meth:`StepMetrics.reduce`'s output (host values; no sync).

    ``elapsed_s``: the interval's wall time without validation; ``names``: the parameter names in
    ``param_sq`` order; ``progress``: data progress and run-wide counters (epoch, samples_seen,
    tokens_seen, num_incidents, ...); ``extra``: anything else for this line (val_loss, world_size).
    The keys are those of :data:`stabletrain.records.events.METRIC_KEYS`.
    """
    total_sq = sum(param_sq) or 1.0
    top = sorted(range(len(param_sq)), key=lambda i: -param_sq[i])[:top_layers]
    ratios = update_ratios(summary)
    top_updates = sorted((i for i, r in enumerate(ratios) if math.isfinite(r)), key=lambda i: -ratios[i])[:top_layers]
    elapsed_s = max(elapsed_s, 1e-9)
    return {
        **{k: v for k, v in summary.items() if not k.startswith("interval_")},
        "tokens_per_s": summary["interval_tokens"] / elapsed_s,
        "samples_per_s": summary["interval_samples"] / elapsed_s,
        "step_time_s": elapsed_s / summary["interval_steps"],
        **progress,
        "top_grad_layers": [{"name": names[i], "share": param_sq[i] / total_sq} for i in top],
        "top_update_layers": [{"name": names[i], "ratio": ratios[i]} for i in top_updates],
        **(extra or {}),
    }


def update_ratios(summary: dict[str, Any]) -> list[float]:
    """Each parameter's ||update|| / ||weight|| at the interval's measured step, from :meth:`StepMetrics.reduce`'s
    summary (host values); an empty list when the interval measured no update. A zero weight gives inf (or NaN)."""
    return [u / w if w > 0 else (math.inf if u > 0 else math.nan)
            for u, w in zip(summary.get("interval_param_update_norms", []), summary.get("interval_param_norms", []))]


def host_figures(record: dict[str, Any]) -> dict[str, Any]:
    """An interval record's numbers for a host trainer's own logger, as ``stabletrain/<key>``."""
    return {f"stabletrain/{k}": v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            and k != "step"}

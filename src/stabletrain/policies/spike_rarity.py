"""The spike rule's rarity bar: a loss as far above the median as recent steps often are is the loss's spread, not a spike.

The rule's window holds the non-spike losses only, so that a run of spikes does not raise its baseline. Under a loss
whose per-step spread is wide and frequent, that left the rule judging a narrower and narrower window: a small batch
with label noise (a third of batch-2 steps hold a mislabelled sample, x30 the median) had each such step flagged and
left out, until 266 of 1,000 steps of a healthy run were spikes, some called a drifted state. So each judged step's
loss over the rule's median then (its ratio) is kept, spikes too, for the last ``spike_window`` steps, and a spike's
ratio must also be above ``spike_ratio`` times the :data:`RARE` quantile (the lower, 9/10) of those ratios as it stood at
the last step not flagged: a ratio a tenth of recent steps reach is no spike, while each step of a burst or a
divergence (flagged steps in a row) is judged against the ratios from before it began. Ratios, not losses: a loss
that falls fast has its older, larger losses in any window of them, and no spread (a spike after a fast fall was
missed against them). It applies once half a window of ratios is in (before, the bar is 1: the rule alone).

The same bar on the device (``guard.on_spike=skip``: a few ops a step, no sync) and on the host (the interval's rows at
the boundary), in float32 and with the same index, so that the two rules agree bit for bit. A median of 0 or below
(an NLL loss can have one) keeps no ratio and sets no bar.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["RarityBar", "RARE"]

#: The quantile, as a fraction (numerator, denominator): the lower value at index (9 (m - 1)) // 10 of m sorted losses.
RARE = (9, 10)
F32_MAX = 2.0 ** 128 - 2.0 ** 103  # (a quotient from here on rounds to inf in float32)


class RarityBar:
    """The last ``cfg.spike_window`` judged steps' loss-over-median ratios (``ring``, spikes included; ``seen`` counted)
    and the quantile (``ref``) as of the last step not flagged. :meth:`passes` and :meth:`update` run on the device
    every step (:meth:`judge`); :meth:`host_passes` and :meth:`host_update` are the same on the host (the ring a numpy
    view)."""

    def __init__(self, cfg: Any, where: torch.device, on_device: bool) -> None:
        self.ratio, self.n, self.full_at = cfg.spike_ratio, cfg.spike_window, max(cfg.spike_window // 2, 2)
        self.ring = torch.full((self.n,), float("nan"), device=where)
        self.seen = torch.zeros((), dtype=torch.long, device=where)
        self.ref = torch.full((), float("-inf"), device=where)
        self.on_device = on_device
        self.starts: tuple[Any, Any] = (None, None)  # the snapshots at the last two log boundaries (:meth:`mark_start`)
        self.live = False  # a spike's capture: the ring as it is now stands just before it (a replay ran the rule)
        self._host_load()

    # -- on the device: no sync -------------------------------------------------------------------------------------
    def judge(self, loss: Tensor, median: Tensor, judged: Tensor, spike: Tensor) -> Tensor:
        """``spike`` (the rule's) where ``loss`` over ``median`` also clears the bar (always while fewer than half a
        window of ratios are in, or where the median is 0 or below); then keep that ratio where ``judged`` (the rule
        armed) and finite, and move the bar unless the step is flagged."""
        r = loss.detach().float() / median
        positive = median > 0
        spike = spike & ((self.seen < self.full_at) | ~positive | (r > self.ratio * self.ref))
        keep = judged & torch.isfinite(r) & positive
        slot = (self.seen % self.n).reshape(1)  # (a 1-element index: a 0-dim CUDA one is read on the host)
        self.ring.index_put_((slot,), torch.where(keep, r, self.ring.gather(0, slot)))
        self.seen += keep.long()
        m = torch.clamp(self.seen, min=1, max=self.n)
        ordered = torch.sort(torch.where(torch.isnan(self.ring), float("inf"), self.ring)).values
        quantile = ordered.gather(0, ((RARE[0] * (m - 1)) // RARE[1]).reshape(1)).reshape(())
        self.ref = torch.where(spike | (self.seen == 0), self.ref, quantile)
        return spike

    # -- on the host: the quantile read only where a spike is judged, and once an interval ----------------------------
    def host_passes(self, loss: float, median: float) -> bool:
        if self._seen < self.full_at or not median > 0:
            return True
        self._fresh()
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # (a tiny median: inf, as on the device)
            return bool(np.float32(loss) / np.float32(median) > np.float32(self.ratio) * np.float32(self._ref))

    def host_update(self, loss: float, median: float | None, spike: bool) -> None:
        """``loss``, ``median``: float32 values (as the rows and the window hold them); ``median`` None: not judged."""
        if spike:  # (its bar, as it stood before it, stays for a run of them: read before this step's ratio is in)
            self._fresh()
        # (in float64, rounded once to float32: the float32 quotient exactly, as 53 >= 2 x 24 + 2 bits; no errstate per row)
        q = loss / median if median is not None and median > 0 and math.isfinite(loss) else math.nan
        r = float(np.float32(q)) if q < F32_MAX else math.nan
        if math.isfinite(r):
            self._ring[self._seen % self.n] = r
            self._seen += 1
        self._stale = not spike

    def _fresh(self) -> None:
        """The bar from the ring as it is now, where the last step was not flagged (as the device updates it)."""
        if self._stale and self._seen:
            values = np.sort(self._ring if self._seen >= self.n else self._ring[~np.isnan(self._ring)])
            self._ref = float(values[(RARE[0] * (len(values) - 1)) // RARE[1]])
        self._stale = False

    def host_done(self) -> None:
        """The host's count and bar into the tensors (their state_dict)."""
        self._fresh()
        self._counts[...] = self._seen  # (numpy views of the CPU tensors: no tensor op per interval)
        self._bar[...] = self._ref

    def _host_load(self) -> None:
        self._ring = None if self.on_device else self.ring.numpy()  # (on the device: no read of its tensors)
        self._counts, self._bar = (None, None) if self.on_device else (self.seen.numpy(), self.ref.numpy())
        self._seen, self._ref, self._stale = (0, -math.inf, False) if self.on_device else (int(self.seen), float(self.ref), False)

    def mark_start(self) -> None:
        """At a log boundary (:meth:`~stabletrain.policies.guard.Guard.mark_spikes`: on the device, at the interval's
        end, a copy and no read; on the host, before it judges the interval's rows)."""
        self.starts = (self.starts[1], self.snapshot())

    def before(self) -> dict[str, Any] | None:
        """The ring before a spike of the interval just judged, for its capture: as it is now where the capture's
        replay ran the rule up to the spike (:attr:`live`), else as the interval began (its steps before the spike
        left out: a few ratios; never the spike's own nor those after it, which a remedy's replay would meet early)."""
        start = self.snapshot() if self.live else self.starts[0 if self.on_device else 1]
        if start is not None and "rare_ring" in start:  # (a device copy: read now, at a capture)
            start = {"ring": start["rare_ring"].tolist(), "seen": int(start["rare_seen"]), "ref": float(start["rare_ref"])}
        return start

    def snapshot(self) -> dict[str, Any]:
        """The ring, count and bar as plain values (an incident bundle's: a replay's rule starts from the run's)."""
        if not self.on_device:  # (the host's own: no tensor read)
            self._fresh()
            return {"ring": self._ring.tolist(), "seen": self._seen, "ref": self._ref}
        return self.state_dict()  # (on the device: copies, read at a capture only: before)

    def load_snapshot(self, snap: dict[str, Any]) -> None:
        self.load_state_dict({"rare_ring": torch.tensor(snap["ring"], dtype=torch.float32),
                              "rare_seen": torch.tensor(snap["seen"]), "rare_ref": torch.tensor(snap["ref"])})

    def state_dict(self) -> dict[str, Tensor]:
        return {"rare_ring": self.ring.clone(), "rare_seen": self.seen.clone(), "rare_ref": self.ref.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """(a checkpoint from before the bar: an empty ring, no bar until half a window of ratios is in again)"""
        if "rare_ring" in state:
            self.ring.copy_(state["rare_ring"])
            self.seen.copy_(state["rare_seen"])
            self.ref.copy_(state["rare_ref"])
        else:
            self.ring.fill_(float("nan"))
            self.seen.zero_()
            self.ref.fill_(float("-inf"))
        self._host_load()

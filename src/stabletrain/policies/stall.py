"""A run that goes on without learning (fp16's GradScaler that cannot recover, gradients that never arrive): the stall
watch the guard keeps over the last ``guard.stall_steps`` steps, and what a stop for it says.

:class:`StallWatch` is fed each interval's rows by :meth:`stabletrain.policies.guard.Guard.decide` (host values; no
sync) and says why the run is stalled (:meth:`StallWatch.stalled`). :func:`routine_overflow` is the line between the
GradScaler's routine skip-and-back-off and an fp16 incident, judged alike by the guard and the remedy search's replay.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import numpy as np

__all__ = ["StallWatch", "UNRECOVERABLE_SCALE", "NEGLIGIBLE_GRAD", "FP16_ADVICE", "REMEDY_ADVICE", "REFERENCE_KEPT", "scale_note",
           "routine_overflow"]

#: fp16: an overflow after which the GradScaler's scale is below this is an incident, not the routine skip: the
#: gradients do not fit float16 even unscaled (or are NaN whatever the scale), and backing off cannot fix that.
UNRECOVERABLE_SCALE = 1.0

#: fp16 stall: at a collapsed loss scale (below :data:`UNRECOVERABLE_SCALE`), applied gradients whose norms are all at
#: most this share of the run's earlier grad norms (the median of its last :data:`REFERENCE_KEPT` applied steps at a
#: scale of at least 1) underflowed: the updates are negligible, the run does not learn (:meth:`StallWatch.stalled`).
NEGLIGIBLE_GRAD = 1e-3
#: What to try when fp16's GradScaler cannot recover (a stall, or every step skipped).
FP16_ADVICE = "precision=bf16 (no loss scale), the overflowing module in fp32 (where stabletrain diagnose names one), or "
#: The verified cures, by whether the run may apply one itself (the built-in loop) or not (an adapter: the host owns the
#: checkpoints a rollback needs; the incident's own remedy search still tells them).
REMEDY_ADVICE = {True: "guard.on_nonfinite=remedy",
                 False: "stabletrain remedy on the incident where one was captured (its cures, verified)"}
REFERENCE_KEPT = 64


def scale_note(scale: float, loss: float, remedy: bool = False, keys: bool = True) -> str:
    """What a stop after consecutive skips says of fp16's GradScaler at ``scale`` (the last step's ``loss``; a scale other
    than 1: fp16's). A non-finite loss under fp16 is the forward's overflow whatever the scale (it stays where it was:
    the scaler backs off on its gradients' overflow only), e.g. an output that outgrew float16 as it trained. ``remedy``:
    whether the run may apply a verified cure itself (:data:`REMEDY_ADVICE`)."""
    if not math.isfinite(loss) and scale != 1.0:  # the loss itself overflowed: it is not scaled yet, no scale makes it finite
        return (f"; the loss itself is non-finite in float16 (an overflow in the forward, or an invalid op) and the "
                f"GradScaler's scale is {scale:.2g}: no loss scale makes it finite. Try {FP16_ADVICE}{REMEDY_ADVICE[remedy]}")
    if scale >= UNRECOVERABLE_SCALE:
        return ""
    return (f"; the GradScaler's scale is {scale:.2g}: the gradients overflow float16 even unscaled (a lower scale may fit "
            f"them: {'guard.' if keys else ''}max_consecutive_skips higher lets it back off further, a skipped step each "
            f"time). Try {FP16_ADVICE}"
            f"{REMEDY_ADVICE[remedy]}")


class StallWatch:
    """The last ``steps`` steps as (applied, grad norm, loss scale, loss), and the grad norms of the last applied steps at
    a healthy loss scale (what "negligible" is against): :meth:`stalled` says whether the run stopped learning."""

    def __init__(self, steps: int, remedy: bool = False, keys: bool = True, warns: bool = False) -> None:
        self.remedy = remedy  # the run may apply a verified cure itself (the advice: REMEDY_ADVICE)
        self.warns = warns  # guard.on_stall=warn: the run trains on (said so, not offered)
        self.keys = keys  # its advice names the built-in run's config keys (False: an adapter's, which has none for these)
        self.recent: deque[tuple[bool, float, float, float | None]] = deque(maxlen=steps)
        self.norm_reference: deque[float] = deque(maxlen=REFERENCE_KEPT)

    def record(self, applied: bool, norm: float, scale: float, loss: float) -> None:
        """One step's figures (host values), in step order."""
        self.recent.append((applied, norm, scale, loss))
        if applied and scale >= UNRECOVERABLE_SCALE and math.isfinite(norm) and norm > 0:
            self.norm_reference.append(norm)

    def stalled(self, step: int) -> str | None:
        """Why the run stopped learning over its last ``guard.stall_steps`` steps, or None (host values; no sync).

        Stalled: no gradient of those steps reached the parameters, either

        - each was skipped or applied with a zero gradient, its loss not 0 (a loss of exactly 0, a hinge's margins
          all met, is convergence), some applied (none applied is ``guard.max_consecutive_skips``' case), or
        - under fp16, the GradScaler's scale is below :data:`UNRECOVERABLE_SCALE`, more than half of the steps were
          skipped and every applied one had a grad norm of at most :data:`NEGLIGIBLE_GRAD` x the run's earlier
          ones (the median of the last applied steps at a scale of at least 1; none seen: this test is not made), or
        - every step was skipped at such a scale (``guard.max_consecutive_skips`` raised past them).

        A GradScaler that cannot recover does that (most steps overflow and back off the scale; at the scale left
        the few applied gradients underflow to 0, or to a tiny remainder, e.g. of an fp32 term of the loss) without
        ever making ``guard.max_consecutive_skips`` skips in a row: the run would end "successfully" without
        learning. An early back-off while the scale calibrates is not a stall: the scale stays above 1 and its
        applied steps move the parameters; a healthy fp16 run's scale does not fall below 1.
        """
        recent = self.recent
        if len(recent) < recent.maxlen:
            return None
        applied = [r for r in recent if r[0]]
        skipped, n, scale = len(recent) - len(applied), len(recent), recent[-1][2]
        norms = [r[1] for r in applied]
        largest = max(norms) if norms and all(math.isfinite(x) for x in norms) else math.nan
        moved = "no gradient reached the parameters"
        if not applied and all(r[2] < UNRECOVERABLE_SCALE for r in recent):  # (each at a collapsed scale: a back-off
            # from 2**16 down through 1 is the GradScaler calibrating, which the next steps may end)
            what = f"all of the last {n} steps were skipped"
        elif largest == 0.0 and not all(r[3] == 0.0 for r in applied):
            what = f"{skipped} of the last {n} steps were skipped and the {len(applied)} applied had a zero gradient"
        elif (applied and scale < UNRECOVERABLE_SCALE and skipped > n / 2 and self.norm_reference
              and (reference := float(np.median(self.norm_reference))) > 0
              and largest <= NEGLIGIBLE_GRAD * reference):  # (a NaN largest or reference fails this)
            what = (f"{skipped} of the last {n} steps were skipped and the {len(applied)} applied had gradient norms of "
                    f"at most {largest:.2g}, under {NEGLIGIBLE_GRAD:g} x the run's earlier {reference:.2g} (they "
                    "underflowed at the loss scale)")
            moved = "no gradient reached the parameters measurably"
        else:
            return None
        if scale != 1.0 and scale >= UNRECOVERABLE_SCALE and largest == 0.0:  # zero gradients at a healthy scale
            what += (f"; the GradScaler's scale is {scale:.2g}: in float16 the gradients underflow to 0 (or the loss does "
                     "not reach the parameters)")
            advice = ("precision=bf16 (float32's range, no loss scale), a larger loss (a sum, not a mean of tiny terms), or "
                      "a look at whether the loss depends on the parameters")
        elif scale != 1.0:
            what += f"; the GradScaler's scale is {scale:.2g}"
            lost = [r for r in recent if not r[0] and r[3] is not None and not math.isfinite(r[3])]  # (None: unrecorded)
            if 2 * len(lost) > skipped:  # most skips' loss itself: the forward's, no scale helps (all: it fell for nothing)
                what += (f"{', fallen for nothing' if len(lost) == skipped else ''} ({len(lost)} of the {skipped} skipped "
                         "steps' loss itself is non-finite in float16, an overflow in the forward, an invalid op or bad "
                         "inputs, which no loss scale makes finite)")  # (no ': ' in it: the last line keeps it whole)
            advice = FP16_ADVICE + REMEDY_ADVICE[self.remedy]
        else:
            advice = "a look at the skip events and the loss (is it constant?), or " + REMEDY_ADVICE[self.remedy]
        return (f"the run is stalled at step {step}: {what}: {moved} "  # (an adapter's: no option of its own for these)
                + (f"(guard.stall_steps={n}). Try {advice}; "
                   + ("training on (guard.on_stall=warn)" if self.warns else "guard.on_stall=warn trains on") if self.keys else
                   f"(the last {n} steps). Try {advice}"))

    def state_dict(self) -> dict[str, Any]:
        return {"recent": [list(r) for r in self.recent], "norm_reference": list(self.norm_reference)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.recent.clear()
        self.recent.extend((bool(a), float(g), float(sc), float(rest[0]) if rest and rest[0] is not None else None)
                           for a, g, sc, *rest in state.get("recent", []))  # (a checkpoint before the loss was kept: None)
        self.norm_reference.clear()
        self.norm_reference.extend(float(x) for x in state.get("norm_reference", []))  # (older checkpoints: none)


def routine_overflow(overflow: bool, loss_scale: float) -> bool:
    """fp16: whether a step's overflow is the GradScaler's routine skip-and-back-off, not an incident: it is, unless the
    scale it left is below :data:`UNRECOVERABLE_SCALE` (the guard and the remedy search's replay judge it alike)."""
    return bool(overflow) and float(loss_scale) >= UNRECOVERABLE_SCALE

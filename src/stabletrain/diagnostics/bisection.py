"""Which samples make a batch go bad: group testing by halving over the batch's dataset indices.

The caller says what "bad" means: :func:`bisect_samples` only searches, over any ``is_bad(subset)``;
:class:`SubsetJudge` is the one a step's diagnosis uses (it replays the step on those samples, as
:func:`stabletrain.diagnostics.diagnosis.run_diagnosis` sets it up).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor
from torch.utils.data import default_collate

from ..numerics import first_nonfinite_grad
from .nonfinite import NonFiniteLocator

__all__ = ["Bisection", "bisect_samples", "SubsetJudge"]


@dataclass
class Bisection:
    """Which samples make a batch go bad.

    Attributes:
        samples: the indices that are bad on their own (sorted).
        combinations: groups of indices that are bad together although no part of them found by
            halving is (each reduced by dropping members while it stays bad); empty when every bad
            group contains a sample bad on its own.
        whole_bad: whether the full set of indices was bad at all.
        num_evals: calls to ``is_bad`` made.
        exhausted: True when ``max_evals`` stopped the search early (the lists may be incomplete).
        unjudged: subsets ``is_bad`` could not replay, counted not bad (the caller's to fill: see
            :class:`SubsetJudge`); with any, a combination is the smallest set found bad, not one
            proven bad only together.
    """

    samples: list[int]
    combinations: list[list[int]]
    whole_bad: bool
    num_evals: int
    exhausted: bool = False
    unjudged: list[list[int]] = field(default_factory=list)

    def summary(self) -> str:
        if not self.whole_bad:
            return "the batch is not bad on replay: no samples to blame"
        parts = []
        if self.samples:
            parts.append(f"bad on its own: sample{'s' if len(self.samples) > 1 else ''} {', '.join(map(str, self.samples))}")
        for group in self.combinations:
            parts.append(f"samples {', '.join(map(str, group))} are the smallest set found bad ({len(self.unjudged)} "
                         "smaller subsets could not be replayed)" if self.unjudged else
                         f"no single sample is bad, but samples {', '.join(map(str, group))} are bad together")
        if not parts:
            parts.append("no single sample or group could be isolated")
        if self.exhausted:
            parts.append("search stopped early (max_evals)")
        return "; ".join(parts)


def bisect_samples(is_bad: Callable[[list[int]], bool], indices: Sequence[int], *, max_evals: int = 200,
                   whole_bad: bool | None = None) -> Bisection:
    """Return which of ``indices`` make ``is_bad`` true, by halving (group testing).

    ``is_bad(subset)`` replays the step on that subset of dataset indices. A group that is bad while
    both its halves are fine is reported as a combination, reduced to a 1-minimal group (no member
    can be dropped). About ``2 k log2(n)`` calls for ``k`` bad samples among ``n``; results are
    cached, so no subset is evaluated twice. ``whole_bad``: ``is_bad(indices)`` when the caller
    already knows it (the step's own replay): not asked again, nor counted in ``num_evals``.
    """
    cache: dict[tuple[int, ...], bool] = {}
    if whole_bad is not None:
        cache[tuple(indices)] = bool(whole_bad)
    state = {"evals": 0, "exhausted": False}

    def bad(subset: list[int]) -> bool:
        key = tuple(subset)
        if key not in cache:
            if state["evals"] >= max_evals:
                state["exhausted"] = True
                return False
            state["evals"] += 1
            cache[key] = bool(is_bad(list(subset)))
        return cache[key]

    singles: list[int] = []
    combos: list[list[int]] = []

    def search(group: list[int]) -> None:  # precondition: bad(group)
        if len(group) == 1:
            singles.append(group[0])
            return
        mid = len(group) // 2
        left, right = group[:mid], group[mid:]
        left_bad, right_bad = bad(left), bad(right)
        if left_bad:
            search(left)
        if right_bad:
            search(right)
        if not left_bad and not right_bad and not state["exhausted"]:
            combos.append(minimize(group))

    def minimize(group: list[int]) -> list[int]:
        for i in list(group):
            rest = [j for j in group if j != i]
            if rest and bad(rest):
                group = rest
        return group

    indices = list(indices)
    whole = bool(indices) and bad(indices)
    if whole:
        search(indices)
    return Bisection(sorted(set(singles)), combos, whole, state["evals"], state["exhausted"])


def _select(batch: Any, positions: list[int], n: int) -> Any:
    """Return the rows ``positions`` of every tensor in ``batch`` whose first dimension is ``n``."""
    if isinstance(batch, Tensor):
        return batch[positions] if batch.dim() > 0 and batch.shape[0] == n else batch
    if isinstance(batch, dict):
        return {k: _select(v, positions, n) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        items = [_select(v, positions, n) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    return batch


class SubsetJudge:
    """``judge(subset)``, the bisection's ``is_bad``: replay only those dataset indices, each in its own micro-batch's group.

    ``mode`` says what "bad" means, after what the whole window showed. ``"loss"`` (its loss was non-finite): the
    subset's loss is non-finite, judged on the forwards alone (no backward: a gradient is not the incident's failure,
    and an fp16 overflow of a subset's scaled gradients is not its NaN). ``"gradients"``: its loss or a gradient is
    non-finite, at ``loss_scale`` (the replayer's ``judging_scale``: fp16, an overflow the GradScaler would skip and
    back off from does not count) or the run's scale. ``"precise"``: also a non-finite value that never reaches either
    (the op-by-op locator). ``passes`` counts the replays (``bisection``, one that raised too) and those that ran no backward
    (``bisection_forward_only``: every one in ``"loss"`` mode, else a subset whose loss is non-finite).

    A subset the model cannot run (a group of one sample under BatchNorm in training mode: "Expected more than 1 value
    per channel") is replayed again with one companion added to each group of one: a sample of that micro-batch seen
    in a subset judged good (the smallest such index). Its verdict is then the subset's: the companion was good
    without it. ``companions`` records, per subset judged so, the samples added; ``unrunnable`` the subsets judged
    neither way (counted not bad) and ``error`` the first error a subset raised, alone.
    """

    def __init__(self, rep: Any, micro_batches: list[tuple[list[int], Any]], dataset: Any,
                 collate: Callable[[list[Any]], Any] | None, mode: str, loss_scale: float | None,
                 passes: dict[str, int]) -> None:
        self.rep, self.micro_batches, self.dataset = rep, micro_batches, dataset
        self.collate = collate or default_collate
        self.mode, self.loss_scale, self.passes = mode, loss_scale, passes
        self.good: set[int] = set()
        self.companions: dict[tuple[int, ...], list[int]] = {}
        self.unrunnable: list[list[int]] = []
        self.error: str | None = None

    def _groups(self, wanted: set[int]) -> list[tuple[list[int], Any]]:
        groups = []
        for indices, batch in self.micro_batches:
            positions = [k for k, i in enumerate(indices) if i in wanted]
            if positions:
                kept = [indices[k] for k in positions]
                sub = (self.collate([self.dataset[i] for i in kept]) if self.dataset is not None
                       else _select(batch, positions, len(indices)))
                groups.append((kept, sub))
        return groups

    def _replay(self, groups: list[tuple[list[int], Any]]) -> bool:
        rep, passes = self.rep, self.passes
        rep.reset()
        passes["bisection"] += 1
        if self.mode == "loss":
            passes["bisection_forward_only"] += 1
            _, loss = rep.forward_backward(groups, stop_at_nonfinite_loss=True, forward_only=True)
            return not math.isfinite(loss)
        kw = {"loss_scale": self.loss_scale} if self.loss_scale is not None else {}
        with (NonFiniteLocator(rep.model, capture_stack=False, first_only=True) if self.mode == "precise"
              else contextlib.nullcontext()) as loc:
            _, loss = rep.forward_backward(groups, stop_at_nonfinite_loss=True, **kw)
        if not math.isfinite(loss):
            passes["bisection_forward_only"] += 1
            return True
        return (loc is not None and loc.found) or first_nonfinite_grad(rep.model) is not None

    def __call__(self, subset: list[int]) -> bool:
        groups = self._groups(set(subset))
        if not groups:
            return False
        try:
            bad = self._replay(groups)
        except (RuntimeError, ValueError) as err:  # torch raises either for a batch it cannot run (BatchNorm: ValueError)
            self.error = self.error or f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
            added = self._companions(subset, [kept[0] for kept, _ in groups if len(kept) == 1])
            try:
                bad = added is not None and self._replay(self._groups(set(subset) | set(added)))
            except (RuntimeError, ValueError):
                added = None
            if added is None:
                self.unrunnable.append(list(subset))
                return False
            self.companions[tuple(subset)] = added
            subset = [*subset, *added]
        if not bad:
            self.good.update(subset)
        return bad

    def _companions(self, subset: list[int], alone: list[int]) -> list[int] | None:
        """One known-good sample of its micro-batch for each sample of ``alone`` (None: some has none, or none is alone)."""
        added = []
        for i in alone:
            pool = self.good.intersection(next(ix for ix, _ in self.micro_batches if i in ix)) - set(subset)
            if not pool:
                return None
            added.append(min(pool))
        return sorted(added) or None

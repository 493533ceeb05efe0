"""Which samples make a batch go bad: group testing by halving over the batch's dataset indices.

The caller says what "bad" means (``is_bad(subset)`` replays the step on those samples: see
:func:`stabletrain.diagnostics.diagnosis.run_diagnosis`); this module only searches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["Bisection", "bisect_samples"]


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
    """

    samples: list[int]
    combinations: list[list[int]]
    whole_bad: bool
    num_evals: int
    exhausted: bool = False

    def summary(self) -> str:
        if not self.whole_bad:
            return "the batch is not bad on replay: no samples to blame"
        parts = []
        if self.samples:
            parts.append(f"bad on its own: sample{'s' if len(self.samples) > 1 else ''} {', '.join(map(str, self.samples))}")
        for group in self.combinations:
            parts.append(f"no single sample is bad, but samples {', '.join(map(str, group))} are bad together")
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

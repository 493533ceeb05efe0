"""The built-in checks by name and one line each, without torch: what ``stabletrain check --help`` and ``--list`` show.

The checks themselves live in this package's other modules, which import torch; they are imported when a check
runs (:func:`stabletrain.checks.run_checks`). A test holds :data:`BUILTIN_CHECKS` equal to what they register
(names, first docstring lines, order, default).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["CheckInfo", "BUILTIN_CHECKS", "require_known"]


@dataclass(frozen=True)
class CheckInfo:
    """A built-in check as listed: its name, the first line of its docstring, and its place in a plain run.

    Attributes:
        name: what ``stabletrain check NAME`` runs.
        description: the first line of the check function's docstring, as written (``--help`` shows it without
            the double backticks).
        order: its ``register(order=...)``: a plain run and ``--help`` follow this order.
        default: run by a plain ``stabletrain check`` (its ``register(default=...)``).
    """

    name: str
    description: str
    order: int
    default: bool = True


#: The built-in checks in the order their modules register them (module by module, alphabetically): the order
#: of ``stabletrain check --list`` and of the known checks an unknown name's error lists.
BUILTIN_CHECKS: tuple[CheckInfo, ...] = (
    CheckInfo("accum", "Compare the gradient of k accumulated micro-batches with that of one big batch "
                       "(fp32, train mode, dropout off).", 20),
    CheckInfo("amp", "Audit op dtypes under autocast, the loss dtype and the parameter dtypes.", 30),
    CheckInfo("clip", "Clip real grads to a threshold below their norm and recompute the norm.", 40),
    CheckInfo("init", "Report per-layer signal propagation at step 0 (and per init scheme with ``compare``); "
                      "pass if nothing is flagged.", 50),
    CheckInfo("nan", "Plant a NaN in a middle layer; pass iff the locator finds that module, in forward, as the "
                     "origin.", 60),
    CheckInfo("overfit", "Overfit one tiny fixed batch; name every trainable parameter that got no gradient.", 10),
    CheckInfo("resume", "Checkpoint after N steps, continue M; restore in a fresh process and compare the M steps.", 70),
    CheckInfo("determinism", "Train the same config twice from scratch; compare every step and the final parameters "
                             "bitwise.", 80),
)


def require_known(names: Iterable[str], known: Iterable[str] = tuple(c.name for c in BUILTIN_CHECKS)) -> None:
    """Raise ValueError for the first of ``names`` not in ``known`` (default: the built-in checks), listing them."""
    known = list(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown check {unknown[0]!r}; known checks: {', '.join(known)}")

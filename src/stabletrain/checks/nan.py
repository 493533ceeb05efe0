"""The ``nan`` check: plant a NaN inside the user's model and verify the locator traces it exactly.

It first replays one clean forward/backward under the locator (a model that already produces a
NaN/Inf, or a false alarm such as an ``-inf`` mask the locator does not recognise, fails here), then
writes a NaN into the input of a middle leaf module (a forward pre-hook runs inside that module)
and passes iff :class:`~stabletrain.diagnostics.nonfinite.NonFiniteLocator` names that module, in forward, as
the origin, and how many parameters' gradients it made non-finite.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import default_collate

from ..data import move_to
from ..diagnostics.nonfinite import NonFiniteLocator
from ..policies.accumulation import as_sum_count
from ..policies.precision import PrecisionPolicy
from . import CheckContext, CheckResult, register


def _first_floating(args: tuple[Any, ...]) -> int | None:
    for i, a in enumerate(args):
        if isinstance(a, Tensor) and a.is_floating_point() and a.numel() > 0:
            return i
    return None


def _plant_nan(module: nn.Module, arg_index: int) -> Any:
    """Register a pre-hook writing NaN into element 0 of the module's input (it runs inside the module)."""

    def hook(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[arg_index].clone(memory_format=torch.contiguous_format)
        x.view(-1)[0].fill_(float("nan"))  # fill_ with a Python NaN: this op is the origin
        return args[:arg_index] + (x,) + args[arg_index + 1:]

    return module.register_forward_pre_hook(hook)


@register("nan", order=60)
def check_nan(ctx: CheckContext) -> CheckResult:
    """Plant a NaN in a middle layer; pass iff the locator finds that module, in forward, as the origin."""
    task = ctx.make_task()
    device = ctx.device
    precision = PrecisionPolicy(ctx.cfg.precision, device)
    model = task.model.to(device)
    model.train()
    n = min(ctx.cfg.train.batch_size, len(task.train_data))
    batch = move_to((task.collate or default_collate)([task.train_data[i] for i in range(n)]), device)

    def forward_backward() -> None:
        model.zero_grad(set_to_none=True)
        with precision.autocast():
            loss_sum, count = as_sum_count(task.loss(model, batch), n)
        precision.backward(loss_sum / count)

    # Clean pass: record which leaf modules with parameters get a floating input, in call order.
    names = {m: name for name, m in model.named_modules()}
    called: list[tuple[str, int]] = []
    seen: set[str] = set()

    def probe(module: nn.Module, args: tuple[Any, ...]) -> None:
        i = _first_floating(args)
        name = names[module]
        if i is not None and name not in seen:
            seen.add(name)
            called.append((name, i))

    leaves = [m for m in model.modules() if not list(m.children()) and any(True for _ in m.parameters(recurse=False))]
    handles = [m.register_forward_pre_hook(probe) for m in leaves]
    try:
        with NonFiniteLocator(model) as clean:
            forward_backward()
    finally:
        for h in handles:
            h.remove()
    if clean.first is not None:
        return CheckResult("nan", False, f"the model is not finite before planting anything: {clean.first.describe()}",
                           numbers={"op": clean.first.op, "module": {"": "(the root module)", None: "(outside any module)"}.get(
                               clean.first.module, clean.first.module)},
                           details=[("fix this first (stabletrain diagnose on a bad step names it), or the locator "
                                     "mistakes an intended inf for a fault")])
    if not called:
        return CheckResult("nan", False, "no leaf module with parameters takes a floating-point input: nowhere to plant a NaN")

    planted, arg_index = called[len(called) // 2]
    module = dict(model.named_modules())[planted]
    handle = _plant_nan(module, arg_index)
    try:
        with NonFiniteLocator(model) as loc:
            forward_backward()
    finally:
        handle.remove()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    bad_grads = int(torch.stack([~torch.isfinite(g).all() for g in grads]).sum()) if grads else 0  # (one host read)
    first = loc.first
    numbers = {"planted_module": planted, "found_module": first.module if first else None,
               "op": first.op if first else None, "direction": first.direction if first else None,
               "origin": first.origin if first else None,
               "candidates": len(called), "ops_checked": loc.num_ops}
    if first is None:
        return CheckResult("nan", False, f"a NaN planted in {planted!r} went unnoticed by the locator", numbers=numbers)
    found_exactly = first.module == planted and first.direction == "forward" and first.origin
    if not found_exactly:
        return CheckResult("nan", False, f"a NaN planted in {planted!r} was traced to {first.describe()}", numbers=numbers,
                           details=[("module tracking disagrees with named_modules(): does the model call its "
                                     "submodules outside its own forward?")])
    if not bad_grads:
        return CheckResult("nan", False, f"the NaN planted in {planted!r} was located, but no gradient became non-finite",
                           numbers=numbers)
    # (which gradient is 'first' is the parameters' registration order, not the backward's: said as a count)
    numbers["nonfinite_grads"] = bad_grads
    return CheckResult("nan", True, f"a NaN planted in {planted!r} is traced to {first.op} in that module "
                                    f"(forward, origin); {bad_grads} of {len(grads)} parameters' gradients are non-finite "
                                    f"after its backward", numbers=numbers)

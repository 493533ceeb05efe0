"""Replay a step captured by an adapter: the captured batch as a dataset, the host's model and loss rebuilt.

An adapter's incident bundle (``RUN_DIR/incidents/step_N/bundle.pt``) is an ordinary stabletrain bundle
whose config names the task :func:`captured_task` (:data:`TASK_SPEC`); its ``task_args`` hold the step's
micro-batches (tensors) and *recipes*: how to rebuild the host's model, loss and optimizer in a new process::

    model:     {"kind": "transformers", "class": "transformers...:GPT2LMHeadModel", "config": {...}}
               {"kind": "lightning", "class": "pkg.mod:LitModel", "hparams": {...}}
               {"kind": "factory", "factory": "pkg.mod:build_model", "kwargs": {...}}
               {"kind": "class", "class": "pkg.mod:Net"}            (built with no arguments)
    loss:      {"kind": "transformers"}    model(**batch).loss
               {"kind": "lightning"}       model.training_step(batch, 0) (its "loss" when it returns a dict)
               {"kind": "function", "function": "pkg.mod:loss_fn"}  loss_fn(model, batch)
    optimizer: {"class": "torch.optim.adamw:AdamW", "defaults": {...}, "groups": [[param names], ...]}

so ``stabletrain diagnose RUN_DIR/incidents/step_N`` replays it exactly as it replays a built-in run's
incident (:func:`stabletrain.incident_replay.diagnose_incident`). A recipe that is None (a model or loss defined
in ``__main__`` or inside a function) cannot be rebuilt in a new process: the capture's own diagnosis
(``diagnosis.json``, made in the training process) is then the record.

Samples are numbered by their position in the step: micro-batch 0's rows first, then micro-batch 1's.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..tasks import Task, TaskError
from .batches import CapturedRows, import_path, items_normalized, load_object, plain_batch, unbundle_batch

__all__ = ["default_compute_loss",
           "divides_by_items", "host_loss_factor", "captured_task", "TASK_SPEC", "TASK_SPECS", "REBUILD_HINT", "loss_from_recipe",
           "model_from_recipe", "model_recipe", "loss_recipe", "optimizer_recipe", "build_optimizer_from_recipe",
           "lightning_loss", "noop_optimizer", "optimizer_factory"]

TASK_SPEC = "stabletrain.records.captured:captured_task"
#: Every name a bundle's config may give this task by (bundles written before it moved name the old module:
#: :data:`stabletrain.tasks.MOVED` resolves it).
TASK_SPECS = (TASK_SPEC, "stabletrain.integrations.replay:captured_task")


def _transformers_loss(model: nn.Module, batch: Any, num_items_in_batch: Any = None, factor: int = 1) -> Tensor:
    """The Hugging Face Trainer's default ``compute_loss``: the model's ``loss`` (a ModelOutput, a dict or a tuple),
    with ``num_items_in_batch`` passed as the Trainer passes it (to a model that takes loss kwargs: the loss is then
    the micro-batch's sum over the whole window's item count, not its own mean), times the Trainer's
    :func:`host_loss_factor` when it passed it (the run's processes: its items were all ranks')."""
    inputs = dict(batch)
    passed = num_items_in_batch is not None and _accepts_loss_kwargs(model)
    if passed:
        inputs["num_items_in_batch"] = num_items_in_batch
    outputs = model(**inputs)
    loss = outputs["loss"] if isinstance(outputs, Mapping) else outputs[0]
    return loss * factor if passed and factor != 1 else loss


def default_compute_loss(trainer: Any) -> bool:
    """Whether a Hugging Face trainer computes its loss as the base Trainer does, with nothing a new process could not
    rebuild."""
    from transformers import Trainer

    return (type(trainer).compute_loss is Trainer.compute_loss and getattr(trainer, "label_smoother", None) is None
            and getattr(trainer, "compute_loss_func", None) is None)


def divides_by_items(trainer: Any, num_items_in_batch: Any) -> bool:
    """Whether a Hugging Face Trainer divides each micro-batch's loss by the window's ``num_items_in_batch`` (its own
    rule: a model that takes loss kwargs, or a ``compute_loss_func``)."""
    return num_items_in_batch is not None and bool(getattr(trainer, "model_accepts_loss_kwargs", False)
                                                   or getattr(trainer, "compute_loss_func", None) is not None)


def host_loss_factor(trainer: Any, num_items_in_batch: Any) -> int:
    """The factor a Hugging Face Trainer's ``compute_loss`` multiplies its loss by (its own rule): under
    ``average_tokens_across_devices`` with a loss divided by the window's ``num_items_in_batch`` (all ranks' items),
    the processes' count (less tensor parallelism's), or ``n_gpu`` for DataParallel; else 1. A replay on one process
    multiplies by it too: without it a 2-rank run's spike replayed at half its loss (no spike by the rule)."""
    args = getattr(trainer, "args", None)
    if (not getattr(args, "average_tokens_across_devices", False) or not divides_by_items(trainer, num_items_in_batch)):
        return 1
    if getattr(args, "n_gpu", 1) > 1:
        return int(args.n_gpu)
    tp = trainer.get_tp_size() if callable(getattr(trainer, "get_tp_size", None)) else 1
    return max(1, int(getattr(trainer.accelerator, "num_processes", 1)) // max(1, int(tp)))


def _accepts_loss_kwargs(model: nn.Module) -> bool:
    """Whether the Trainer would pass loss kwargs to ``model`` (its own rule: the attribute, else a ``**kwargs``)."""
    if hasattr(model, "accepts_loss_kwargs"):
        return bool(model.accepts_loss_kwargs)
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values())


@contextlib.contextmanager
def _quiet_log(model: nn.Module) -> Any:
    """A replay runs training_step outside a Trainer, where its ``self.log()`` warns on every step; the filter only there
    (a module in its Trainer, a live capture's, warns of nothing: the user's warning filters stay as they are)."""
    try:
        attached = getattr(model, "trainer", None) is not None  # (Lightning's public property: it raises when unattached)
    except RuntimeError:
        attached = False
    if attached:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"You are trying to `self\.log\(\)` but the `self\.trainer` reference")
        yield


def lightning_loss(model: nn.Module, batch: Any) -> Tensor:
    """``model.training_step(batch, 0)``'s loss, run as the module's own call.

    Run through ``model(...)`` so that module names under the locator (torch's ModuleTracker names modules
    from the first module called) are rooted at the LightningModule: ``net.root``, not ``Net.root``. A
    ``self(x)`` inside ``training_step`` (the usual pattern) runs the module's own ``forward``.
    """
    own = vars(model).get("forward")  # one the host set on the instance (Lightning's compiled forward) is put back
    inner = own if own is not None else type(model).forward.__get__(model)
    depth = [0]

    def forward(*args: Any, **kwargs: Any) -> Any:
        if depth[0]:  # training_step's own self(x): the module's forward, not training_step again on x
            return inner(*args, **kwargs)
        depth[0] += 1
        try:
            return model.training_step(*args, 0)
        finally:
            depth[0] -= 1

    model.forward = forward  # an instance attribute, removed below
    try:
        with _quiet_log(model):
            out = model(batch)
    finally:
        del model.forward
        if own is not None:
            model.forward = own
    return out["loss"] if isinstance(out, Mapping) else out


def loss_from_recipe(recipe: dict[str, Any] | None, host: dict[str, Any] | None = None) -> Callable[[nn.Module, Any], Any]:
    """Return ``loss(model, batch)`` for a loss recipe (see the module docstring); ``host``: the captured step's own
    inputs to it (a Hugging Face step's ``num_items_in_batch``)."""
    kind = (recipe or {}).get("kind")
    if kind == "transformers":
        items, window = (host or {}).get("num_items_in_batch"), (host or {}).get("window_items")
        if items is None:
            return _transformers_loss
        loss = functools.partial(_transformers_loss, num_items_in_batch=items, factor=(host or {}).get("loss_factor", 1))
        # (a bundle written before window_items was kept: the scalar, right for its whole window only)
        return items_normalized(loss, window, _accepts_loss_kwargs) if window else loss
    if kind == "lightning":
        return lightning_loss
    if kind == "function":
        return load_object(recipe["function"])
    raise TaskError("the loss cannot be rebuilt in a new process (it was a lambda, or defined in __main__ or inside a "
                    "function); its diagnosis.json was written when it was captured (`stabletrain diagnose` shows it). "
                    "To replay it again, pass a module-level loss function (loss_fn=) to the adapter")


#: What makes a host's model rebuildable in a new process, said when it is not.
REBUILD_HINT = {
    "monitor": "pass model_factory='module:function' to stabletrain.Monitor",
    "lightning": "define the LightningModule at module level and call self.save_hyperparameters() in its __init__ "
                 "(with plain-valued arguments)",
    "transformers": "use a model class defined at module level: a PreTrainedModel (rebuilt from its config) or one "
                    "built with no arguments",
}


def model_from_recipe(recipe: dict[str, Any] | None, host: str | None = None) -> nn.Module:
    """Build a model (random init; the bundle's state is loaded over it) from a model recipe.

    ``host``: the adapter that captured it (monitor, lightning, transformers): what to do is said per host.
    """
    kind = (recipe or {}).get("kind")
    if kind == "transformers":
        cls = load_object(recipe["class"])
        return cls(cls.config_class.from_dict(recipe["config"]))
    if kind == "lightning":
        return load_object(recipe["class"])(**recipe.get("hparams", {}))
    if kind == "factory":
        return load_object(recipe["factory"])(**recipe.get("kwargs", {}))
    if kind == "class":
        return load_object(recipe["class"])()
    if kind == "none":
        raise TaskError(f"the model cannot be rebuilt in a new process: {recipe['why']}; its diagnosis.json was written "
                        "when it was captured (`stabletrain diagnose` shows it)")
    raise TaskError("the model cannot be rebuilt in a new process: the adapter recorded no way to build it (a "
                    "torch.nn container such as nn.Sequential, whose layers are not recorded; a class defined in "
                    "__main__ or inside a function; or one that needs constructor arguments); its diagnosis.json was "
                    "written when it was captured (`stabletrain diagnose` shows it). To replay it again, "
                    + REBUILD_HINT.get(host or "", REBUILD_HINT["monitor"]))


def model_recipe(model: nn.Module, host: str, factory: str | Callable[[], nn.Module] | None = None) -> dict | None:
    """How a new process rebuilds ``model`` (what :func:`model_from_recipe` reads; None: it cannot).

    ``factory``: ``"module:function"`` or the function that builds it; else by the model's class as ``host``
    (lightning, transformers, monitor) would build it: from its hyperparameters, its config, no arguments.
    """
    if factory is not None:
        path = factory if isinstance(factory, str) else import_path(factory)
        if path:
            return {"kind": "factory", "factory": path, "kwargs": {}}
        name = getattr(factory, "__qualname__", repr(factory))
        where = ("in __main__ (the script you ran)" if getattr(factory, "__module__", None) == "__main__" else
                 "inside a function (a lambda or a closure)")
        return {"kind": "none", "why": f"the model_factory given, {name}, is defined {where}: a new process cannot import "
                                       "it; define it in a module and pass it, or 'module:function'"}
    cls = import_path(type(model))
    kind = type(model)
    if not cls and (kind.__module__ == "__main__" or "<locals>" in kind.__qualname__):
        where = "in __main__ (the script you ran)" if kind.__module__ == "__main__" else "inside a function"
        return {"kind": "none", "why": f"the model's class, {kind.__qualname__}, is defined {where}: a new process cannot "
                                       "import it; move it into a module and import it from there"
                                       + (", or pass model_factory='module:function'" if host == "monitor" else "")}
    if not cls:
        return None
    if host == "lightning":
        try:
            hparams = dict(model.hparams)
            plain_batch(hparams)  # only values a safe bundle can hold
        except (TypeError, AttributeError):
            return None
        return {"kind": "lightning", "class": cls, "hparams": hparams}
    config = getattr(model, "config", None)  # (the HF Trainer's model: a PreTrainedModel from its config, or a plain
    if host == "transformers" and config is not None and hasattr(type(model), "config_class"):  # module, by its class,
        return {"kind": "transformers", "class": cls, "config": config.to_dict()}  # when it takes no arguments: the
    if host == "transformers" and not _takes_no_arguments(kind):  # callback has no model_factory= to say how)
        return None
    return {"kind": "class", "class": cls} if not cls.startswith("torch.nn.") else None


def _takes_no_arguments(cls: type) -> bool:
    """Whether ``cls()`` needs no argument (every parameter of its constructor has a default)."""
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return False
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)


def loss_recipe(loss_fn: Callable[..., Any] | None, default: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """How a new process gets the loss: ``loss_fn`` by its import path (None when it has none: a lambda, a
    closure), or without one the host's own (``default``, e.g. ``{"kind": "lightning"}``)."""
    if loss_fn is None:
        return default
    path = import_path(loss_fn)
    return {"kind": "function", "function": path} if path else None


def optimizer_recipe(optimizer: torch.optim.Optimizer, named_params: list[tuple[str, nn.Parameter]]) -> dict | None:
    """Return how to rebuild ``optimizer`` over a rebuilt model (None when a parameter has no name or the class no path)."""
    path = import_path(type(optimizer))
    names = {id(p): n for n, p in named_params}
    groups = []
    for group in optimizer.param_groups:
        if any(id(p) not in names for p in group["params"]):
            return None
        groups.append([names[id(p)] for p in group["params"]])
    defaults = {k: (float(v) if isinstance(v, Tensor) else v) for k, v in optimizer.defaults.items()
                if isinstance(v, (bool, int, float, str, tuple, Tensor)) or v is None}
    return {"class": path, "defaults": defaults, "groups": groups} if path else None


def build_optimizer_from_recipe(recipe: dict[str, Any], named_params: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    """Build the optimizer a recipe describes over ``named_params`` (its state is loaded from the bundle)."""
    by_name = dict(named_params)
    groups = [{"params": [by_name[n] for n in names]} for names in recipe["groups"]]
    cls = load_object(recipe["class"])
    # defaults may hold keys the constructor does not take (AdamW's decoupled_weight_decay): pass only its own.
    accepted = inspect.signature(cls.__init__).parameters
    return cls(groups, **{k: v for k, v in recipe["defaults"].items() if k in accepted})


def noop_optimizer(named_params: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    """The stand-in when the host's optimizer cannot be rebuilt: an lr-0 SGD (the update stage then finds nothing)."""
    return torch.optim.SGD([p for _, p in named_params], lr=0.0)


def optimizer_factory(recipe: dict[str, Any] | None) -> Callable[[list[tuple[str, nn.Parameter]]], torch.optim.Optimizer]:
    """A Task's ``optimizer`` from an optimizer recipe: the host's optimizer rebuilt, or :func:`noop_optimizer`."""
    return (lambda named: build_optimizer_from_recipe(recipe, named)) if recipe else noop_optimizer


def captured_task(batches: list[Any], model: dict[str, Any] | None = None, loss: dict[str, Any] | None = None,
                  optimizer: dict[str, Any] | None = None, name: str = "captured", host: dict[str, Any] | None = None) -> Task:
    """Return the Task that replays a captured adapter step: its micro-batches as a dataset, the host's model and loss.

    Args:
        batches: the step's micro-batches (plain containers of tensors).
        model, loss, optimizer: recipes (see the module docstring); None where it cannot be rebuilt.
        name: the task's name.
        host: the host's own inputs to the step (``num_items_in_batch`` for a Hugging Face loss).
    """
    rows = CapturedRows([unbundle_batch(b) for b in batches])
    return Task(model=model_from_recipe(model, name.partition(":")[0]), train_data=rows, loss=loss_from_recipe(loss, host),
                collate=rows.collate, name=name, optimizer=optimizer_factory(optimizer))

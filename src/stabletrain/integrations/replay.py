"""Replay a step captured by an adapter: the captured batch as a dataset, the host's model and loss rebuilt.

An adapter's incident bundle (``RUN_DIR/incidents/step_N/bundle.pt``) is an ordinary stabletrain bundle
whose config names the task :func:`captured_task`; its ``task_args`` hold the step's micro-batches
(tensors) and *recipes*: how to rebuild the host's model, loss and optimizer in a new process::

    model:     {"kind": "transformers", "class": "transformers...:GPT2LMHeadModel", "config": {...}}
               {"kind": "lightning", "class": "pkg.mod:LitModel", "hparams": {...}}
               {"kind": "factory", "factory": "pkg.mod:build_model", "kwargs": {...}}
               {"kind": "class", "class": "pkg.mod:Net"}            (built with no arguments)
    loss:      {"kind": "transformers"}    model(**batch).loss
               {"kind": "lightning"}       model.training_step(batch, 0) (its "loss" when it returns a dict)
               {"kind": "function", "function": "pkg.mod:loss_fn"}  loss_fn(model, batch)
    optimizer: {"class": "torch.optim.adamw:AdamW", "defaults": {...}, "groups": [[param names], ...]}

so ``stabletrain diagnose RUN_DIR/incidents/step_N`` replays it exactly as it replays a built-in run's
incident (:func:`stabletrain.replay.diagnose_incident`). A recipe that is None (a model or loss defined
in ``__main__`` or inside a function) cannot be rebuilt in a new process: the capture's own diagnosis
(``diagnosis.json``, made in the training process) is then the record.

Samples are numbered by their position in the step: micro-batch 0's rows first, then micro-batch 1's.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..tasks import Task, TaskError

__all__ = ["captured_task", "CapturedRows", "import_path", "load_object", "plain_batch", "bundle_batch",
           "unbundle_batch", "to_host", "batch_nbytes", "batch_size", "optimizer_recipe", "build_optimizer_from_recipe"]

TASK_SPEC = "stabletrain.integrations.replay:captured_task"


def import_path(obj: Any) -> str | None:
    """Return ``module:qualname`` of a class or function importable in a new process, else None."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not qualname or module == "__main__" or "<" in qualname:
        return None
    return f"{module}:{qualname}"


def load_object(path: str) -> Any:
    """Import ``module:qualname``."""
    module_name, _, qualname = path.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def plain_batch(batch: Any) -> Any:
    """Return ``batch`` with its tensors detached on the CPU, its containers rebuilt (namedtuples kept as such).

    Raises TypeError for a leaf that is not a tensor, a number, a string, a bool or None.
    """
    if isinstance(batch, Tensor):
        return batch.detach().cpu()
    if isinstance(batch, Mapping):  # a dict, or a BatchEncoding
        return {k: plain_batch(v) for k, v in batch.items()}
    if _is_namedtuple(batch):
        return type(batch)(*(plain_batch(v) for v in batch))
    if isinstance(batch, tuple):
        return tuple(plain_batch(v) for v in batch)
    if isinstance(batch, list):
        return [plain_batch(v) for v in batch]
    if batch is None or isinstance(batch, (bool, int, float, str)):
        return batch
    raise TypeError(f"a batch leaf of type {type(batch).__name__} cannot be stored in an incident bundle")


#: How a namedtuple is written into a bundle (which holds only plain containers: it loads with weights_only=True).
NAMEDTUPLE = "__namedtuple__"


def bundle_batch(batch: Any) -> Any:
    """``batch`` (from :func:`plain_batch`) as a bundle holds it: a namedtuple becomes a marked dict."""
    if _is_namedtuple(batch):
        return {NAMEDTUPLE: import_path(type(batch)) or type(batch).__name__,
                "fields": {k: bundle_batch(v) for k, v in zip(batch._fields, batch)}}
    if isinstance(batch, dict):
        return {k: bundle_batch(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(bundle_batch(v) for v in batch)
    return batch


def unbundle_batch(batch: Any) -> Any:
    """Undo :func:`bundle_batch`: a marked dict becomes its namedtuple again (when its class imports)."""
    if isinstance(batch, dict) and NAMEDTUPLE in batch:
        fields = {k: unbundle_batch(v) for k, v in batch["fields"].items()}
        try:
            cls = load_object(batch[NAMEDTUPLE])
        except Exception:
            from collections import namedtuple

            cls = namedtuple(batch[NAMEDTUPLE].rpartition(":")[2].rpartition(".")[2] or "Batch", list(fields))
        return cls(**fields)
    if isinstance(batch, dict):
        return {k: unbundle_batch(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(unbundle_batch(v) for v in batch)
    return batch


def to_host(batch: Any, ready: list[Any]) -> Any:
    """A copy of ``batch``'s containers with its CUDA tensors copied to host memory without a sync.

    CPU tensors are kept as they are (references); each CUDA device's copies complete at the event
    appended to ``ready``.
    """
    devices: set[torch.device] = set()

    def walk(x: Any) -> Any:
        if isinstance(x, Tensor):
            if x.device.type == "cuda":
                devices.add(x.device)
                return x.detach().to("cpu", non_blocking=True)
            return x
        if isinstance(x, Mapping):
            items = {k: walk(v) for k, v in x.items()}
            try:
                return type(x)(items)
            except Exception:
                return items
        if _is_namedtuple(x):
            return type(x)(*(walk(v) for v in x))
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v) for v in x)
        return x

    out = walk(batch)
    for device in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        ready.append(event)
    return out


def batch_nbytes(batch: Any) -> int:
    """The bytes of ``batch``'s tensors."""
    leaves, _ = tree_flatten(batch)
    return sum(x.numel() * x.element_size() for x in leaves if isinstance(x, Tensor))


def batch_size(batch: Any) -> int:
    """Return the leading dimension of the first tensor in ``batch`` that has one (1 when none does)."""
    leaves, _ = tree_flatten(batch)
    for leaf in leaves:
        if isinstance(leaf, Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return 1


class CapturedRows(torch.utils.data.Dataset):
    """The samples of a step's micro-batches, one item per row, numbered across micro-batches.

    Every tensor whose leading dimension is its micro-batch's size is split into rows; other leaves
    are shared. :meth:`collate` stacks rows back, bitwise equal to the original batch.
    """

    def __init__(self, batches: list[Any]) -> None:
        self.items: list[tuple[int, int]] = []
        self.parts = []
        for m, batch in enumerate(batches):
            leaves, spec = tree_flatten(batch)
            n = batch_size(batch)
            split = [isinstance(x, Tensor) and x.dim() > 0 and x.shape[0] == n for x in leaves]
            self.parts.append((leaves, spec, split))
            self.items += [(m, i) for i in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[int, int, list[Any]]:
        m, i = self.items[index]
        leaves, _, split = self.parts[m]
        return m, i, [x[i] if s else x for x, s in zip(leaves, split)]

    def collate(self, rows: list[tuple[int, int, list[Any]]]) -> Any:
        """Stack rows (of one micro-batch's structure) back into a batch."""
        m = rows[0][0]
        _, spec, split = self.parts[m]
        leaves = [torch.stack([r[2][j] for r in rows]) if s else rows[0][2][j] for j, s in enumerate(split)]
        return tree_unflatten(leaves, spec)

    def indices(self) -> list[list[int]]:
        """The sample numbers of each micro-batch, in order (a bundle's ``window.indices``)."""
        out: list[list[int]] = [[] for _ in self.parts]
        for k, (m, _) in enumerate(self.items):
            out[m].append(k)
        return out

    def where(self, index: int) -> dict[str, int]:
        """Return ``{"micro_batch": m, "position": i}`` of sample number ``index``."""
        m, i = self.items[index]
        return {"micro_batch": m, "position": i}


def _transformers_loss(model: nn.Module, batch: Any) -> Tensor:
    """The Hugging Face Trainer's default ``compute_loss``: the model's ``loss`` (a ModelOutput, a dict or a tuple)."""
    outputs = model(**batch)
    return outputs["loss"] if isinstance(outputs, Mapping) else outputs[0]


def _lightning_loss(model: nn.Module, batch: Any) -> Tensor:
    """``model.training_step(batch, 0)``'s loss, run as the module's own call.

    Run through ``model(...)`` so that module names under the locator (torch's ModuleTracker names modules
    from the first module called) are rooted at the LightningModule: ``net.root``, not ``Net.root``.
    """
    own = vars(model).get("forward")  # one the host set on the instance (Lightning's compiled forward) is put back
    model.forward = lambda b: model.training_step(b, 0)  # an instance attribute, removed below
    try:
        out = model(batch)
    finally:
        del model.forward
        if own is not None:
            model.forward = own
    return out["loss"] if isinstance(out, Mapping) else out


def loss_from_recipe(recipe: dict[str, Any] | None) -> Callable[[nn.Module, Any], Any]:
    """Return ``loss(model, batch)`` for a loss recipe (see the module docstring)."""
    kind = (recipe or {}).get("kind")
    if kind == "transformers":
        return _transformers_loss
    if kind == "lightning":
        return _lightning_loss
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
    "transformers": "use a model class defined at module level, built from its config (a PreTrainedModel)",
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
    raise TaskError("the model cannot be rebuilt in a new process: the adapter recorded no way to build it (a "
                    "torch.nn container such as nn.Sequential, whose layers are not recorded; a class defined in "
                    "__main__ or inside a function; or one that needs constructor arguments); its diagnosis.json was "
                    "written when it was captured (`stabletrain diagnose` shows it). To replay it again, "
                    + REBUILD_HINT.get(host or "", REBUILD_HINT["monitor"]))


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


def _sgd_noop(named_params: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    """The stand-in when the host's optimizer cannot be rebuilt: an lr-0 SGD (the update stage then finds nothing)."""
    return torch.optim.SGD([p for _, p in named_params], lr=0.0)


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
    opt_factory = ((lambda named: build_optimizer_from_recipe(optimizer, named)) if optimizer else _sgd_noop)
    return Task(model=model_from_recipe(model, name.partition(":")[0]), train_data=rows, loss=loss_from_recipe(loss), collate=rows.collate,
                name=name, optimizer=opt_factory)

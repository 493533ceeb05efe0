"""How an incident bundle holds a host's batches: plain containers of CPU tensors, one row per sample.

An adapter keeps the micro-batches of each step of an interval (:func:`to_host`: off the device without a sync)
and writes the bad step's into its bundle (:func:`plain_batch`, :func:`bundle_batch`: a namedtuple as a marked
dict, so the bundle loads with ``torch.load(weights_only=True)``); :class:`CapturedRows` makes them a dataset
again, one item per row, numbered across micro-batches, so the diagnosis's bisection can drop samples.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from ..internals import tree_flatten, tree_unflatten

__all__ = ["window_items", "items_normalized", "import_path", "load_object", "plain_batch", "bundle_batch",
           "unbundle_batch", "to_host", "batch_nbytes", "batch_size", "count_tokens", "CapturedRows", "NAMEDTUPLE"]


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


def count_tokens(inputs: Mapping[str, Any]) -> Tensor | int:
    """The tokens a Hugging Face style batch's loss covers (on the device, no sync): ``labels != -100``, else the
    attention mask's ones, else the input ids, else the embedded inputs' (batch, sequence), else the samples."""
    labels, mask, ids = inputs.get("labels"), inputs.get("attention_mask"), inputs.get("input_ids")
    embeds = inputs.get("inputs_embeds")
    if isinstance(labels, Tensor) and labels.dtype in (torch.long, torch.int):
        return (labels != -100).sum()
    if isinstance(mask, Tensor):
        return mask.sum()
    if isinstance(ids, Tensor):
        return ids.numel()
    return embeds.shape[:2].numel() if isinstance(embeds, Tensor) and embeds.dim() >= 3 else batch_size(inputs)


def window_items(batches: list[Any]) -> float:
    """The items (:func:`count_tokens`) a whole optimizer step's micro-batches cover, as a host number."""
    return float(sum(float(count_tokens(b)) for b in batches))


def items_normalized(loss: Callable[[Any, Any], Any], items: float,
                     applies: Callable[[Any], bool] = lambda model: True) -> Callable[[Any, Any], Any]:
    """A loss divided by the whole window's item count (a Hugging Face loss given ``num_items_in_batch``), as the pair
    (the micro-batch's loss x the window's ``items``, the micro-batch's own items): summed over the window it is the
    host's loss, and a part of the window (one sample, the window without some, another step's window) gets its own
    items' mean on the same scale (the scalar, divided by the window's count, made any part look small). A model for
    which ``applies(model)`` is false (the host did not pass it the count) keeps the scalar."""

    def pair(model: Any, batch: Any) -> Any:
        out = loss(model, batch)
        if not isinstance(out, Tensor) or out.dim() != 0 or not applies(model):
            return out
        return out.float() * items, count_tokens(batch)

    return pair


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



"""Shared-memory staging for the checkpoint writer process: one block of host memory, reused save after save.

A background save copies the state into host buffers the writer process reads (:mod:`.writer`). Here
those buffers are slices of one anonymous shared-memory block (a Linux ``memfd``, handed to the writer
once as a file descriptor), so a save sends the writer only the state's small skeleton: its containers
and plain values, with a :class:`Slot` where each tensor was. The block and its slices are kept while
the state's layout (each tensor's shape and dtype) stays the same, so after the first save staging is
one ``_foreach_copy_`` per device and nothing is allocated, mapped or sent but the skeleton.

Each slice is a tensor of its own storage (``torch.frombuffer`` at its offset), so ``torch.save`` in the
writer stores each tensor on its own, as it would the live state. Views of the same memory with the
same layout (tied weights) share one slot, so the file holds them once. From CUDA the block is
page-locked (``cudaHostRegister``), and the copies are queued without waiting for the device: the
returned events say when they are complete.
"""

from __future__ import annotations

import mmap
import os
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..staging import PLAIN_TYPES, map_leaves

__all__ = ["Slot", "Staged", "SharedBlock", "SharedStager", "slot_tensors", "fill_slots"]

_ALIGN = 64  # bytes: every slice starts on a cache line (and so on any dtype's alignment)


@dataclass(frozen=True)
class Slot:
    """Where a staged tensor went: slice ``index`` of the shared block (a leaf of a staged skeleton)."""

    index: int


def _spans(specs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> tuple[list[int], int]:
    """Return (each slice's offset, the bytes they need) for tensors of these (shape, dtype), in order."""
    offsets, end = [], 0
    for shape, dtype in specs:
        offsets.append(end)
        numel = 1
        for n in shape:
            numel *= n
        end += -(-numel * dtype.itemsize // _ALIGN) * _ALIGN
    return offsets, end


def slot_tensors(buffer: Any, specs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> list[Tensor]:
    """Return one tensor per (shape, dtype) in ``specs``, each its own storage over its slice of ``buffer``.

    ``buffer``: a writable buffer (an ``mmap``) of at least :func:`_spans`' bytes. The same call in the
    parent and in the writer, over the same shared block, gives tensors over the same memory.
    """
    offsets, _ = _spans(specs)
    out = []
    for (shape, dtype), offset in zip(specs, offsets):
        numel = 1
        for n in shape:
            numel *= n
        if numel == 0:  # frombuffer refuses an empty slice; nothing to share
            out.append(torch.empty(shape, dtype=dtype))
        else:
            out.append(torch.frombuffer(buffer, dtype=dtype, count=numel, offset=offset).view(shape))
    return out


def fill_slots(skeleton: Any, tensors: Sequence[Tensor]) -> Any:
    """Return ``skeleton`` with each :class:`Slot` replaced by its tensor (the same object for the same slot)."""
    return map_leaves(skeleton, lambda x: tensors[x.index] if type(x) is Slot else x)


class SharedBlock:
    """An anonymous shared-memory block (``memfd``) of ``size`` bytes, mapped here; ``fd`` goes to the writer.

    ``pin``: page-lock it for CUDA's non-blocking copies (unlocked by :meth:`close`). Linux only (``memfd_create``).
    """

    def __init__(self, size: int, *, pin: bool = False) -> None:
        if not hasattr(os, "memfd_create"):
            raise RuntimeError("the checkpoint writer process needs Linux's memfd_create (shared memory for the "
                               f"staged state); this is {os.uname().sysname if hasattr(os, 'uname') else os.name}")
        self.size = max(size, mmap.PAGESIZE)
        self.fd = os.memfd_create("stabletrain-checkpoint", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.size)
            self.map = mmap.mmap(self.fd, self.size)
        except BaseException:
            os.close(self.fd)
            raise
        self.pinned: int | None = None  # the page-locked address, when pinned
        if pin:
            base = torch.frombuffer(self.map, dtype=torch.uint8)
            ptr = base.data_ptr()
            del base
            code = int(torch.cuda.cudart().cudaHostRegister(ptr, self.size, 1))  # 1: cudaHostRegisterPortable
            if code != 0:
                os.close(self.fd)
                self.map.close()
                raise RuntimeError(f"page-locking the checkpoint's {self.size} bytes of shared memory failed "
                                   f"(cudaHostRegister error {code})")
            self.pinned = ptr
        self._closer = weakref.finalize(self, _release, self.fd, self.map, self.pinned)
        self._closer.atexit = not pin  # page-locked: not after CUDA's own teardown at exit (the OS frees it)

    def close(self) -> None:
        """Unmap and close the block here (the writer's mapping, if any, stays until it drops its own)."""
        self._closer()


def _release(fd: int, buffer: mmap.mmap, pinned: int | None) -> None:
    if pinned is not None:
        torch.cuda.cudart().cudaHostUnregister(pinned)
    os.close(fd)
    try:
        buffer.close()
    except BufferError:  # a tensor still views it: the mapping goes with the last of them
        pass


@dataclass
class Staged:
    """What :meth:`SharedStager.stage` returns.

    ``skeleton``: the state with a :class:`Slot` per distinct tensor (containers rebuilt, plain values as
    they are, anything else as it is: pickle it at once). ``specs``: each slot's (shape, dtype) when the
    layout changed since the last call, else None. ``block``: the new shared block when one was made (its
    ``fd`` must reach the writer before the layout is used), else None. ``events``: the CUDA events to wait
    on before the writer reads the block.
    """

    skeleton: Any
    specs: list[tuple[tuple[int, ...], torch.dtype]] | None
    block: SharedBlock | None
    events: list[Any]


class SharedStager:
    """Copy a nested state into a :class:`SharedBlock`, reused while the state's layout stays the same.

    Staging again overwrites the slices: only after the writer has finished with the previous copy (the
    manager keeps one save in flight). A layout that still fits the block reuses it.
    """

    def __init__(self) -> None:
        self.block: SharedBlock | None = None
        self.specs: list[tuple[tuple[int, ...], torch.dtype]] = []
        self._tensors: list[Tensor] = []

    @property
    def num_bytes(self) -> int:
        """Host memory the shared block holds."""
        return self.block.size if self.block is not None else 0

    def stage(self, state: Any) -> Staged:
        """Copy ``state``'s tensors into the block; return the :class:`Staged` skeleton. Raises nothing of its own."""
        slots: dict[tuple[Any, ...], Slot] = {}
        sources: list[Tensor] = []
        strided = torch.strided

        def leaf(x: Tensor) -> Any:
            if x.layout != strided or x.is_quantized or (type(x) is not Tensor and type(x) is not torch.nn.Parameter):
                return x.detach().to("cpu", copy=True)  # rare in a state dict: goes whole into the skeleton
            key = (x.device, x.dtype, x.data_ptr(), x.shape, x.stride())  # the same view of the same memory: one slot
            slot = slots.get(key)
            if slot is None:
                slot = slots[key] = Slot(len(sources))
                sources.append(x)
            return slot

        def walk(x: Any) -> Any:
            t = type(x)
            if t in PLAIN_TYPES:
                return x
            if t is dict:  # comprehensions, not generators: a state has hundreds of entries
                return {k: v if type(v) in PLAIN_TYPES else walk(v) for k, v in x.items()}
            if isinstance(x, Tensor):
                return leaf(x)
            if t is OrderedDict:
                return OrderedDict([(k, v if type(v) in PLAIN_TYPES else walk(v)) for k, v in x.items()])
            if t is list:
                return [v if type(v) in PLAIN_TYPES else walk(v) for v in x]
            if t is tuple:
                return tuple([v if type(v) in PLAIN_TYPES else walk(v) for v in x])
            return x

        skeleton = walk(state)
        specs = [(tuple(s.shape), s.dtype) for s in sources]
        pin = any(s.is_cuda for s in sources)
        new_block = None
        changed = specs != self.specs
        if changed or (pin and self.block is not None and self.block.pinned is None):
            _, size = _spans(specs)
            if self.block is None or self.block.size < size or (pin and self.block.pinned is None):
                self._tensors = []
                if self.block is not None:
                    self.block.close()
                self.block = new_block = SharedBlock(size, pin=pin)
            self._tensors = slot_tensors(self.block.map, specs)
            self.specs, changed = specs, True
        events = []
        groups: dict[torch.device, tuple[list[Tensor], list[Tensor]]] = {}
        for dst, src in zip(self._tensors, sources):
            pair = groups.setdefault(src.device, ([], []))
            pair[0].append(dst)
            pair[1].append(src.detach())
        with torch.no_grad():
            for device, (dst, src) in groups.items():
                on_cuda = device.type == "cuda"
                torch._foreach_copy_(dst, src, non_blocking=on_cuda)  # from CUDA into page-locked memory: queued
                if on_cuda:
                    event = torch.cuda.Event()
                    event.record(torch.cuda.current_stream(device))
                    events.append(event)
        return Staged(skeleton, specs if changed else None, new_block, events)

    def close(self) -> None:
        """Release the block (the writer is told separately)."""
        self._tensors = []
        if self.block is not None:
            self.block.close()
            self.block = None
        self.specs = []

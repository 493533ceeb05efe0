"""Where an exception came from: the part of the user's task that raised it and the user's own frames.

An error raised in a user's loss, model, dataset, collate or task factory must keep the user's
file:line and say which part of the task raised it; an error stabletrain raises about its own input
(config, task contract, files, checkpoints) stays one line. :func:`task_part` tells the two apart
from the traceback alone: the frames of stabletrain, torch and the stdlib are never the user's.
:class:`StopTraining` is what an adapter raises when the sentinel stops the host's run.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import re
import sys
import sysconfig
import traceback
from pathlib import Path
from typing import Any

__all__ = ["exit_call", "user_frames", "user_location", "defined_at", "caller_loss_note", "format_user_traceback", "task_part",
           "host_retry", "retried", "retry_line", "raised_by_stabletrain", "format_task_error", "batch_note", "half_params",
           "TaskCodeError", "TASK_PARTS", "brief", "crash_event", "StopTraining", "short_cause"]

_PACKAGE = os.path.join(str(Path(__file__).resolve().parent), "")  # ".../stabletrain/", with its separator


def _library_dirs() -> tuple[str, ...]:
    """Where installed code lives, each with its separator: the stdlib, this interpreter's site-packages, the system's
    a venv sees and the user's, and any other site-packages or dist-packages folder on ``sys.path`` (a ``.pth`` file or
    PYTHONPATH can put one there: torch's frames from it are not the user's)."""
    import site

    paths = [sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")]
    try:
        paths += [*site.getsitepackages(), site.getusersitepackages()]
    except AttributeError:  # an old virtualenv's site module
        pass
    paths += [p for p in sys.path if os.path.basename(os.path.normpath(p)) in ("site-packages", "dist-packages")]
    return tuple({os.path.join(os.path.realpath(p), "") for p in paths if p})


_LIBS = _library_dirs()

#: The parts of a task an exception can come from, as :func:`task_part` names them ("task module": importing it).
TASK_PARTS = ("task module", "factory", "dataset item", "collate", "loss", "model forward", "model backward", "task code")


def brief(value: object, limit: int = 200) -> str:
    """Return ``repr(value)`` fit for a one-line error message: never a tensor's values, at most ``limit`` characters.

    A tensor or array with dimensions (anywhere inside dicts, lists and tuples) is shown as
    ``Tensor(shape=[16, 8], dtype=torch.float32)``; an object whose repr spans lines (a module) as
    ``<Sequential>``; the whole is cut at ``limit`` with "...". Error messages show task arguments and
    config values this way: a captured batch inside them must not print its numbers.
    """
    def one(v: object) -> str:
        shape = getattr(v, "shape", None)
        if shape is not None and hasattr(v, "dtype") and not isinstance(v, (str, bytes)) and len(shape) > 0:
            return f"{type(v).__name__}(shape={list(shape)}, dtype={v.dtype})"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{one(k)}: {one(x)}" for k, x in v.items()) + "}"
        if isinstance(v, (list, tuple)) and type(v) in (list, tuple):
            inner = ", ".join(one(x) for x in v)
            return f"[{inner}]" if isinstance(v, list) else f"({inner}{',' if len(v) == 1 else ''})"
        text = repr(v)
        return f"<{type(v).__name__}>" if "\n" in text else text

    text = one(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_ours(filename: str) -> bool:
    return os.path.realpath(filename).startswith(_PACKAGE)


def _is_user(filename: str) -> bool:
    path = os.path.realpath(filename)
    if path.startswith(_PACKAGE) or filename.startswith("<") or path.startswith(_LIBS):
        return False
    torch = sys.modules.get("torch")  # torch from anywhere (a source checkout on PYTHONPATH) is not the user's either
    return torch is None or not path.startswith(os.path.join(os.path.dirname(os.path.realpath(torch.__file__)), ""))


def _in(frame: traceback.FrameSummary, *parts: str) -> bool:
    """Whether the frame's file path ends with ``parts`` (``"utils", "data"`` also matches a file inside that folder)."""
    path = frame.filename.replace("\\", "/")
    return f"/{'/'.join(parts)}" in path


def _ours_in(frame: traceback.FrameSummary, *parts: str) -> bool:
    """Whether the frame is stabletrain's file (or folder) ``parts`` (``"tasks"``, ``"step.py"``), read from the package's
    own folder: never from folder names in the path, which a checkout named ``stabletrain`` shares."""
    rel = os.path.relpath(os.path.realpath(frame.filename), _PACKAGE).replace("\\", "/")
    return not rel.startswith("..") and (rel == "/".join(parts) or rel.startswith("/".join(parts) + "/"))


_WORKER_TRACEBACK = "Original Traceback (most recent call last):"
_FRAME_LINE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>.+)$')


def _worker_frames(err: BaseException) -> list[traceback.FrameSummary]:
    """The frames of a DataLoader worker's traceback, which torch re-raises as text in the message."""
    text = str(err)
    if _WORKER_TRACEBACK not in text:
        return []
    lines = text.split(_WORKER_TRACEBACK, 1)[1].splitlines()
    frames = []
    for i, line in enumerate(lines):
        m = _FRAME_LINE.match(line)
        if m:
            code = lines[i + 1].strip() if i + 1 < len(lines) and not _FRAME_LINE.match(lines[i + 1]) else None
            frames.append(traceback.FrameSummary(m["file"], int(m["line"]), m["name"], lookup_line=False, line=code))
    return frames


def _below_stabletrain(err: BaseException) -> list[traceback.FrameSummary]:
    """``err``'s frames from the outermost stabletrain frame in (all of them when there is none).

    The frames above it are a user's script calling stabletrain (``Trainer(...).fit()``): where the
    call came from, not the code that raised. A DataLoader worker's frames (in the message) come last.
    """
    frames = traceback.extract_tb(err.__traceback__)
    start = next((i for i, f in enumerate(frames) if _is_ours(f.filename)), 0)
    return frames[start:] + _worker_frames(err)


def _exception_line(err: BaseException) -> str:
    """The last line of a traceback: ``Type: message`` (a DataLoader worker's: the original exception's line)."""
    if _worker_frames(err):
        last = [line for line in str(err).splitlines() if line.strip()][-1]
        notes = "".join(f"{note}\n" for note in getattr(err, "__notes__", ()))
        return f"{last}\n(raised in a DataLoader worker process)\n{notes}"
    text = "".join(traceback.format_exception_only(type(err), err))
    if sys.version_info < (3, 11):  # from 3.11 on, format_exception_only prints the notes itself
        text += "".join(f"{note}\n" for note in getattr(err, "__notes__", ()))
    return text


def user_frames(err: BaseException) -> list[traceback.FrameSummary]:
    """The frames of ``err``'s traceback that are the user's code (not stabletrain, torch or the stdlib).

    Only those below stabletrain's outermost frame: the task code stabletrain called, not the script that called it.
    """
    return [f for f in _below_stabletrain(err) if _is_user(f.filename)]


def user_location(err: BaseException) -> str | None:
    """``file:line in function`` of the deepest user frame of ``err``, or None when there is none.

    A SyntaxError in a file (a task module that does not parse) is located where it points: ``file:line:column``.
    """
    if isinstance(err, SyntaxError) and err.filename and not err.filename.startswith("<"):
        return f"{err.filename}:{err.lineno}" + (f":{err.offset}" if err.offset else "")
    frames = user_frames(err)
    if not frames:
        return None
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}"


def defined_at(fn: Any) -> str | None:
    """``file:line in name`` where the user's callable ``fn`` is defined, or None when it is not the user's code.

    Through ``functools.partial`` and ``functools.wraps``; a bound method is its function's, a callable object its
    class's ``forward`` (a module) or ``__call__``. The line is the ``def`` (or the ``lambda``), not a line inside it.
    """
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = inspect.unwrap(fn) if callable(fn) else fn
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None and callable(fn):  # a callable object: an nn.Module's forward, else its class's __call__
        code = getattr(getattr(type(fn), "forward", None) or type(fn).__call__, "__code__", None)
    if code is None or not _is_user(code.co_filename):
        return None
    return f"{code.co_filename}:{code.co_firstlineno} in {code.co_name}"


def caller_loss_note(depth: int = 2) -> str:
    """`` (defined at file:line in name)`` for the user's loss function (:func:`defined_at`) that the stabletrain frame
    ``depth`` levels up called, read from that frame's locals (``loss_fn``, ``loss``, ``task.loss``, ``<x>.task.loss``);
    "" when there is none. For checking what a loss returned after its own frame is gone: the message names its line.
    """
    frame = inspect.currentframe()
    for _ in range(depth):
        frame = frame.f_back if frame is not None else None
    try:
        if frame is None:
            return ""
        found = [frame.f_locals.get(name) for name in ("loss_fn", "loss")]
        for name, value in frame.f_locals.items():
            task = value if name == "task" else getattr(value, "task", None)
            found.append(getattr(task, "loss", None))
        where = next((where for fn in found if callable(fn) and (where := defined_at(fn))), None)
    except Exception:  # an object's own __getattr__: the note is a courtesy, never a second error
        where = None
    finally:
        del frame  # a frame kept in a local is a reference cycle
    return f" (defined at {where})" if where else ""


def format_user_traceback(err: BaseException) -> str:
    """The traceback of ``err`` with only the user's frames, then the exception line."""
    frames = user_frames(err)
    lines = ["Traceback (your code; stabletrain's and library frames trimmed):\n"] if frames else []
    lines += traceback.format_list(frames)
    lines.append(_exception_line(err))
    return "".join(lines)


def raised_by_stabletrain(err: BaseException) -> bool:
    """Whether ``err`` was raised in one of stabletrain's own frames (its innermost frame is stabletrain's)."""
    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and _is_ours(frames[-1].filename)


def _data_part(bridge: list[traceback.FrameSummary]) -> str | None:
    """The part named by torch's DataLoader frames between stabletrain and the user's code, if any."""
    for f in bridge:
        if _in(f, "utils", "data", "_utils", "fetch.py"):
            return "collate" if "collate" in (f.line or "") else "dataset item"
        if _in(f, "utils", "data", "_utils", "collate.py"):
            return "collate"
    if any(_in(f, "utils", "data", "dataloader.py") and f.name == "_process_data" for f in bridge):
        return "dataset item or collate (in a DataLoader worker)"
    return None


_LOSS_CALL = re.compile(r"\bloss(?:_fn)?\(")


def _autograd(frame: traceback.FrameSummary) -> bool:
    return _in(frame, "torch", "autograd") or (_in(frame, "torch", "_tensor.py") and frame.name == "backward")


def task_part(err: BaseException) -> str | None:
    """Return which part of the user's task raised ``err`` (one of :data:`TASK_PARTS`), or None if none did.

    Read from the traceback: the innermost stabletrain frame before the user's code is the call into the
    task (the factory call in ``resolve_task``, the loss call in the step, a dataset or collate call in
    torch's DataLoader), and the frames below it say more: a user frame entered through
    ``nn.Module.__call__`` (or a torch module raising on what the user's code passed it) is "model
    forward", one entered through autograd "model backward". The validation pass adds "(validation)".
    Importing the module of ``task=module:function`` is "task module" (of a ``callbacks`` entry: "callbacks module").
    Without any user frame only torch's DataLoader or ``default_collate`` working on the user's data,
    and a loss that is a torch function, count as the task's; anything else is not the task's (None).
    """
    frames = _below_stabletrain(err)
    users = [i for i, f in enumerate(frames) if _is_user(f.filename)]
    first = users[0] if users else len(frames)
    ours = [i for i in range(first) if _is_ours(frames[i].filename)]
    if not ours or ours[-1] == len(frames) - 1:
        return None  # not called from stabletrain, or raised by stabletrain itself
    entry, below = frames[ours[-1]], frames[ours[-1] + 1:]
    if _ours_in(entry, "tasks", "__init__.py") and entry.name == "import_object":
        # Importing the module a spec names raised: a SyntaxError, or the module's own top-level code.
        return "task module" if any(frames[i].name == "_import_factory" for i in ours) else "callbacks module"
    if _ours_in(entry, "tasks") and not _ours_in(entry, "tasks", "__init__.py"):
        return None  # a built-in task is stabletrain's own code
    bridge = frames[ours[-1] + 1:first]  # library frames between stabletrain and the user's code
    line = entry.line or ""
    part = _data_part(bridge)
    if part is None and any(_autograd(f) for f in bridge):
        part = "model backward" if users else None
    elif part is None and not users:
        part = "loss" if _LOSS_CALL.search(line) else None
    elif part is None:
        callee = frames[first]
        if _ours_in(entry, "tasks", "__init__.py"):
            part = "factory"
        elif callee.name in ("__getitem__", "__getitems__"):
            part = "dataset item"
        elif "collate" in line and not _LOSS_CALL.search(line):
            part = "collate"
        elif _LOSS_CALL.search(line) or _ours_in(entry, "step.py"):
            part = "loss"
        elif "model(" in line or "module(" in line:
            part = "model forward"
        else:
            part = "task code"
    if part is None:
        return None
    if part in ("loss", "task code"):  # the loss called the model, and the error came from inside it
        for f, nxt in zip(below, below[1:]):
            if _in(f, "torch", "nn", "modules", "module.py") and f.name == "_call_impl" \
                    and not _in(nxt, "torch", "nn", "modules", "loss.py"):
                part = "model forward"
                break
    if _ours_in(entry, "evaluation.py"):
        part += " (validation)"
    return part


def format_task_error(err: BaseException, part: str) -> str:
    """Return the lines a user reads for an exception from their task: which part, where, their frames, the error."""
    where = user_location(err)
    subject = f"the {part}" if part.endswith("module") else f"the task's {part}"
    step = getattr(err, "stabletrain_step", None)  # (the training loop's: the step whose work raised it)
    head = f"{subject} raised {type(err).__name__}" + (f" at {where}" if where else "") + (
        f", in step {step}" if isinstance(step, int) else "")
    if part.startswith("collate") and where is None:
        odd = _odd_items(err)
        head += (f" in torch's default_collate: {odd}; default_collate stacks items of one shape: fix the item, or pad "
                 "them in a collate(samples) -> batch (Task.collate)" if odd else
                 " in torch's default_collate, which cannot batch these samples: give the task a collate(samples) -> "
                 "batch (Task.collate)")
    return "\n".join(x for x in (head, batch_note(err, part), format_user_traceback(err).rstrip("\n")) if x)


def _odd_items(err: BaseException) -> str | None:
    """Which dataset items of the batch default_collate failed on differ in shape from the rest ("dataset item 17 is
    (4, 3) where the batch's other 7 are (4,)"), from the DataLoader fetcher's frame (its indices and items); None where
    that frame is not in the traceback (a worker process's error) or no item stands out."""
    torch = sys.modules.get("torch")
    tb = err.__traceback__
    while tb is not None and torch is not None:
        local = tb.tb_frame.f_locals
        if tb.tb_frame.f_code.co_name == "fetch" and isinstance(local.get("data"), list) and "possibly_batched_index" in local:
            def shape(x: Any) -> Any:
                if isinstance(x, torch.Tensor):
                    return tuple(x.shape)
                if isinstance(x, dict):
                    return tuple((k, shape(v)) for k, v in x.items())
                return tuple(shape(v) for v in x) if isinstance(x, (tuple, list)) else type(x).__name__

            items, indices = local["data"], list(local["possibly_batched_index"])
            shapes = [shape(x) for x in items]
            usual = max(set(shapes), key=shapes.count)
            odd = [(i, sh) for i, sh in zip(indices, shapes) if sh != usual]
            if not odd or len(odd) * 2 > len(shapes) or len(indices) != len(shapes) or not all(
                    isinstance(i, int) for i in indices):  # (an IterableDataset's fetcher: no index, None each)
                return None
            listed = ", ".join(f"{i} is {sh}" for i, sh in odd[:3]) + (" ..." if len(odd) > 3 else "")
            return f"dataset item {listed} where the batch's other {len(shapes) - len(odd)} are {usual}"
        tb = tb.tb_next
    return None


def batch_note(err: BaseException, part: str) -> str | None:
    """Say what the batch held that is not a tensor, for a TypeError from the task's loss or model forward: a dataset
    returning strings ends in one from the first torch module they reach ("must be Tensor, not tuple"), which names neither.

    The batch is the argument after the model in the frame of the user's loss that stabletrain called (its locals
    live as long as the traceback). None for another error or part, when that frame is not there, or when every
    leaf of the batch is a tensor or a number.
    """
    clash = isinstance(err, RuntimeError) and any(s in str(err) for s in _DTYPE_CLASH)  # (a .half() model's forward)
    if not (isinstance(err, TypeError) or clash) or part.split(" (")[0] not in ("loss", "model forward"):
        return None
    torch = sys.modules.get("torch")
    tb, caller_ours = err.__traceback__, False
    while tb is not None and torch is not None:
        frame, filename = tb.tb_frame, tb.tb_frame.f_code.co_filename
        if caller_ours and _is_user(filename):  # the user's loss(model, batch), as stabletrain called it
            code = frame.f_code
            args = [frame.f_locals.get(name) for name in code.co_varnames[:code.co_argcount]]
            after_model = [b for a, b in zip(args, args[1:]) if isinstance(a, torch.nn.Module)]
            if not after_model:
                return None
            if clash:
                return _cast_note(next(a for a in args if isinstance(a, torch.nn.Module)))
            odd = _non_tensors(after_model[0], "batch", torch)
            if not odd:
                return None
            listed = "; ".join(f"{path} is {what}" for path, what in odd[:4]) + ("; ..." if len(odd) > 4 else "")
            return (f"the batch holds values that are not tensors: {listed}. A model takes tensors: return them "
                    "(or numbers) from the dataset's __getitem__, or build them in Task.collate or the loss")
        caller_ours = _is_ours(filename)
        tb = tb.tb_next
    return None


#: What torch says when a float16/bfloat16 weight meets a float32 input (or the other way round).
_DTYPE_CLASH = ("must have the same dtype", "expected scalar type", "should be the same", "expected m1 and m2 to have the same")


def half_params(model: Any) -> tuple[str, int] | None:
    """``("16 of 16 parameters are stored in float16 (e.g. net.0.weight)", 16)`` where ``model``'s trainable parameters
    are float16/bfloat16 (a model cast wholesale, ``.half()``; a frozen bf16 base under LoRA adapters is no such cast),
    else None."""
    low = [(n, p.dtype) for n, p in model.named_parameters() if p.requires_grad and str(p.dtype) in ("torch.float16",
                                                                                                      "torch.bfloat16")]
    if not low:
        return None
    total = sum(1 for p in model.parameters() if p.requires_grad)
    one = len(low) == 1
    return (f"{len(low)} of {total} parameter{'' if total == 1 else 's'} {'is' if one else 'are'} stored in "
            f"{str(low[0][1]).removeprefix('torch.')} (e.g. {low[0][0]})", len(low))


def _cast_note(model: Any) -> str | None:
    """The mismatch's cause where the model was cast wholesale (a trial's `.half()` model failed each check with 'mat1 and
    mat2 must have the same dtype' and no word of it)."""
    half = half_params(model)
    return None if half is None else (f"{half[0]}: the model was cast wholesale (.half()/.bfloat16()) and meets float32 "
                                      "inputs: keep float32 weights and let autocast choose (precision=bf16)")


def _non_tensors(value: Any, path: str, torch: Any, depth: int = 0) -> list[tuple[str, str]]:
    """``(path, what)`` for each part of a batch that is neither a tensor nor a number (``batch[0]``: "a tuple of 16 str")."""
    if torch.is_tensor(value) or value is None or isinstance(value, (bool, int, float)) or depth > 4:
        return []
    if isinstance(value, dict):
        return [found for key, v in list(value.items())[:16] for found in _non_tensors(v, f"{path}[{key!r}]", torch, depth + 1)]
    if isinstance(value, (list, tuple)):
        kinds = {type(v).__name__ for v in value}
        if value and len(kinds) == 1 and not isinstance(value[0], (list, tuple, dict)) and not torch.is_tensor(value[0]):
            if isinstance(value[0], (bool, int, float)):
                return []
            return [(path, f"a {type(value).__name__} of {len(value)} {kinds.pop()}")]
        return [found for i, v in enumerate(value[:16]) for found in _non_tensors(v, f"{path}[{i}]", torch, depth + 1)]
    return [(path, f"a {type(value).__name__}")]


class TaskCodeError(Exception):
    """An exception raised inside the user's task code; ``part`` says which (loss, dataset item, ...)."""

    def __init__(self, part: str, err: BaseException) -> None:
        self.part, self.cause = part, err
        where = user_location(err)
        super().__init__(f"{type(err).__name__} in the task's {part}{f' at {where}' if where else ''}: {err}")


def crash_event(err: BaseException, during: str, step: int | None = None) -> tuple[str, dict[str, Any]]:
    """The ``crash`` event of ``err``: its reason (with the user's file:line) and its fields. ``step``: the training step
    whose work raised it, kept on ``err`` for the console's line (:func:`format_task_error`)."""
    if step is not None:
        with contextlib.suppress(AttributeError, TypeError):  # (an exception with __slots__ keeps none)
            err.stabletrain_step = step  # type: ignore[attr-defined]
    where = user_location(err)
    reason = f"{type(err).__name__}: {err}" + (f" (at {where})" if where else "")
    return reason, {"error": type(err).__name__, "message": str(err), "location": where, "during": during,
                    "part": task_part(err)}


def clean_exit(err: BaseException) -> bool:
    """Whether ``err`` is a SystemExit that Python ends the process with exit code 0 (``sys.exit()``, ``sys.exit(0)``,
    ``sys.exit(False)``; not ``sys.exit("")`` nor ``sys.exit(0.0)``, which exit 1)."""
    return isinstance(err, SystemExit) and (err.code is None or (isinstance(err.code, int) and err.code == 0))


def exit_call(err: SystemExit) -> str:
    """``err``'s exit as a ``sys.exit`` call with its code: ``sys.exit()``, ``sys.exit(0)``, ``sys.exit('bye')`` (a ``raise
    SystemExit``, ``exit()`` or a library's own exit reads the same: the exception carries its code, not its spelling)."""
    return "sys.exit()" if err.code is None else f"sys.exit({err.code!r})"


class StopTraining(RuntimeError):
    """The sentinel stopped the run (``on_nonfinite="stop"`` or too many consecutive skips); ``step`` and ``reason`` say why."""

    def __init__(self, step: int, reason: str) -> None:
        self.step, self.reason = step, reason
        super().__init__(f"stabletrain stopped the run at step {step}: {reason}")


def host_retry(args: Any, err: BaseException, step: int, batch: int | None = None) -> dict[str, Any] | None:
    """A ``retry`` event's fields for an out-of-memory error that a host trainer retries at a smaller batch (transformers'
    ``auto_find_batch_size``, by accelerate's own test), else None (the error ends the run: a crash; at ``batch`` 1 there
    is no smaller one: accelerate gives up). Under more than one process, none: a rank's retry is its own, its peers go
    on into the step's collectives (closing the session as a retry would start the interval's on this rank alone)."""
    if (not getattr(args, "auto_find_batch_size", False) or not isinstance(err, Exception) or (batch or 2) <= 1
            or (getattr(args, "world_size", 1) or 1) > 1):
        return None
    try:
        from accelerate.utils.memory import should_reduce_batch_size
    except ImportError:
        return None
    return {"failed_step": step, "error": brief(str(err))} if should_reduce_batch_size(err) else None


def retried(retry: dict[str, Any] | None, open_at: int | None, args: Any, now: int | None, was: int | None
            ) -> dict[str, Any] | None:
    """At a host trainer's train start: the retry it is, if its batch size shrank from ``was`` to ``now`` (a new train()
    at the same size is none): the out-of-memory ``retry`` its training step recorded, or, where an error elsewhere left
    the session open (at step ``open_at``) under ``auto_find_batch_size``, one outside the training step."""
    if retry is None and open_at is not None and getattr(args, "auto_find_batch_size", False):
        retry = {"after_step": open_at, "error": "out of memory outside its training step"}
    return {**retry, "batch_size_was": was} if retry and now is not None and was is not None and now < was else None


def retry_line(retry: dict[str, Any], batch_size: int) -> str:
    """What a :func:`retried` says when the host trains again at ``batch_size``."""
    where = (f"at step {retry['failed_step']}" if "failed_step" in retry
             else f"after step {retry['after_step']} (outside its training step)")
    return (f"the Trainer ran out of memory {where} and trains again from its first step at batch "
            f"size {batch_size} (from {retry['batch_size_was']}; auto_find_batch_size): this run directory holds the new "
            "attempt")


def short_cause(message: str) -> str:
    """Return the gist of a gloo/NCCL error: its first line without source paths and boilerplate."""
    line = message.strip().splitlines()[0] if message.strip() else "no message"
    line = re.sub(r"\[[^\]]*\.(cpp|cc|h|hpp):\d+\]\s*", "", line)
    line = line.split(". This is typically caused by")[0]
    line = re.sub(r"^Got the following error when running the callback:\s*", "", line)
    return line[:200]

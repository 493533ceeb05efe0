"""Every reach into another library's private internals is in ``stabletrain.internals`` (issue 35, section 5).

A scan of the package's source (``internals.py`` aside) for what belongs to someone else and is private by
its name (one leading underscore; dunders are public):

- an import of a private module or name: ``from torch.utils._pytree import ...``, ``import torch._dynamo``;
- an attribute of another library's module: ``torch._C``, ``sys._getframe`` (any module the file imports);
- an underscore attribute of any other object that stabletrain does not define itself (a ``def``, a class,
  a module-level name, a class attribute or ``self._x = ...``): ``module._parameters``, ``t._local_tensor``,
  ``fp._unsharded_param``, also by name (``getattr(x, "_x")``, ``hasattr``, ``setattr``, ``delattr``);
- ``super()._x`` in a class whose base is not stabletrain's (overriding another library's private method).

What it cannot see: a private override that never calls ``super()``, a name stabletrain happens to define
too. :data:`ALLOWED` is the short list of underscore names that are documented public API.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "stabletrain"
EXEMPT = PACKAGE / "internals.py"

#: Underscore names that are public API despite the underscore; each with where it is documented.
ALLOWED: dict[str, str] = {
    # os._exit: https://docs.python.org/3/library/os.html#os._exit (exit without cleanup, after fork or a fatal error)
    "os._exit": "documented in Python's os module",
    # namedtuple's own API is underscored so that it cannot clash with a field name
    # (https://docs.python.org/3/library/collections.html#collections.somenamedtuple._fields)
    "*._fields": "namedtuple's documented attribute",
    "*._asdict": "namedtuple's documented method",
    "*._replace": "namedtuple's documented method",
}
#: torch's multi-tensor kernels (torch._foreach_norm, _foreach_mul_, ...): what torch.nn.utils.clip_grad and
#: torch.optim themselves call; torch's main branch publishes them as ``torch.foreach`` (not in 2.13) and keeps
#: the ``torch._foreach_*`` names "for compatibility during migration" (docs.pytorch.org/docs/main/foreach.html).
ALLOWED_PREFIXES: dict[str, str] = {"torch._foreach_": "torch's multi-tensor ops (torch.foreach)"}


@functools.lru_cache(maxsize=None)
def _walk(node: ast.AST) -> tuple[ast.AST, ...]:
    """``ast.walk(node)``, once per node (the scans walk each tree and its functions several times)."""
    return tuple(ast.walk(node))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _sources() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text(encoding="utf-8"), str(path)) for path in sorted(PACKAGE.rglob("*.py"))}


def own_names(trees: dict[Path, ast.Module]) -> tuple[set[str], dict[str, set[str]], dict[str, list[str]]]:
    """(every name stabletrain defines; each class's own names; each class's base names), from its source."""
    names: set[str] = set()
    members: dict[str, set[str]] = {}
    bases: dict[str, list[str]] = {}
    for tree in trees.values():
        for node in _walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            if isinstance(node, ast.ClassDef):
                own = members.setdefault(node.name, set())
                bases[node.name] = [ast.unparse(b).split(".")[-1] for b in node.bases]
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        own.add(item.name)
                    targets = item.targets if isinstance(item, ast.Assign) else (
                        [item.target] if isinstance(item, ast.AnnAssign) else [])
                    own.update(t.id for t in targets if isinstance(t, ast.Name))
                for sub in _walk(node):
                    if (isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store)
                            and isinstance(sub.value, ast.Name) and sub.value.id in ("self", "cls")):
                        own.add(sub.attr)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for sub in _walk(target):
                        if isinstance(sub, ast.Name):
                            names.add(sub.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)) and (isinstance(node, ast.Import) or node.level):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
    for tree in trees.values():  # made = OwnClass(...); made._x = ...: an attribute of stabletrain's own object
        for func in _walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            made = {t.id: node.value.func.id for node in _walk(func) if isinstance(node, ast.Assign)
                    and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
                    and node.value.func.id in members for t in node.targets if isinstance(t, ast.Name)}
            for node in _walk(func):
                if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                        and isinstance(node.value, ast.Name) and node.value.id in made):
                    members[made[node.value.id]].add(node.attr)
    for own in members.values():
        names |= own
    return names, members, bases


def _annotations(tree: ast.Module) -> set[int]:
    """The ids of the nodes inside annotations, where the module never evaluates them (``from __future__ import
    annotations``): a private class named in a type hint is not reached at run time."""
    if not any(isinstance(n, ast.ImportFrom) and n.module == "__future__" and any(a.name == "annotations" for a in n.names)
               for n in tree.body):
        return set()
    found: set[int] = set()
    for node in _walk(tree):
        hints = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            hints = [a.annotation for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs,
                                             node.args.vararg, node.args.kwarg] if a is not None] + [node.returns]
        elif isinstance(node, ast.AnnAssign):
            hints = [node.annotation]
        found.update(id(sub) for hint in hints if hint is not None for sub in _walk(hint))
    return found


def _allowed(dotted: str) -> bool:
    last = "*." + dotted.rsplit(".", 1)[-1]
    return dotted in ALLOWED or last in ALLOWED or any(dotted.startswith(p) for p in ALLOWED_PREFIXES)


def _foreign_modules(tree: ast.Module) -> dict[str, str]:
    """Local name -> the other library's module it is bound to (``import torch.distributed as dist``: dist)."""
    bound = {}
    for node in _walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] != "stabletrain":
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module and node.module != "__future__":
            if node.module.split(".")[0] != "stabletrain":
                for a in node.names:
                    bound[a.asname or a.name] = f"{node.module}.{a.name}"
    return bound


def _chain(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ["a", "b", "c"]; None for anything that is not a chain of names."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _inherits(cls: str, name: str, members: dict[str, set[str]], bases: dict[str, list[str]], seen=()) -> bool:
    """Whether a stabletrain base of class ``cls`` defines ``name`` (by class name, through stabletrain's classes)."""
    for base in bases.get(cls, []):
        if base in members and base not in seen and (name in members[base] or
                                                     _inherits(base, name, members, bases, (*seen, base))):
            return True
    return False


def reaches(path: Path, tree: ast.Module, own: set[str], members: dict[str, set[str]],
            bases: dict[str, list[str]]) -> list[str]:
    """The private reaches in one file, as ``file:line: what``."""
    where = path.relative_to(PACKAGE.parent)
    modules = _foreign_modules(tree)
    hints = _annotations(tree)
    found = []

    def report(node: ast.AST, what: str) -> None:
        found.append(f"{where}:{node.lineno}: {what}")

    classes: dict[ast.AST, ast.ClassDef] = {}  # each node -> the class it sits in
    for node in _walk(tree):
        if isinstance(node, ast.ClassDef):
            for sub in _walk(node):
                classes.setdefault(sub, node) if sub is not node else None
    for node in _walk(tree):
        if id(node) in hints:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] != "stabletrain" and any(_private(p) for p in a.name.split(".")):
                    report(node, f"import {a.name}")
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] in ("stabletrain", "__future__"):
                continue
            for a in node.names:
                dotted = f"{node.module}.{a.name}"
                if any(_private(p) for p in dotted.split(".")) and not _allowed(dotted):
                    report(node, f"from {node.module} import {a.name}")
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            chain = _chain(node)
            if chain is not None and chain[0] in modules:
                dotted = ".".join([modules[chain[0]], *chain[1:]])
                if not _allowed(dotted):
                    report(node, dotted)
            elif (isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
                  and node.value.func.id == "super"):
                cls = classes.get(node)
                if cls is None or not _inherits(cls.name, node.attr, members, bases):
                    report(node, f"super().{node.attr} (another library's private method)")
            elif isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            elif node.attr not in own and not _allowed(f"?.{node.attr}"):
                report(node, f"{ast.unparse(node)} (no stabletrain definition of {node.attr})")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value) and node.args[1].value not in own
              and not _allowed(f"?.{node.args[1].value}")):
            report(node, f"{node.func.id}(..., {node.args[1].value!r})")
    return found


def test_no_private_reach_outside_internals():
    trees = _sources()
    own, members, bases = own_names(trees)
    found = [line for path, tree in trees.items() if path != EXEMPT
             for line in reaches(path, tree, own, members, bases)]
    _walk.cache_clear()
    assert not found, ("private internals reached outside stabletrain/internals.py (move each there, with its "
                       "check, or use the public API):\n" + "\n".join(found))


@pytest.mark.parametrize(("source", "bad"), [
    ("from torch.utils._pytree import tree_map\n", True),
    ("import torch\nx = torch._C._current_graph_task_id()\n", True),
    ("import torch.distributed as dist\ndist._functional_collectives\n", True),
    ("def f(module):\n    del module._parameters['w']\n", True),
    ("def f(t):\n    return hasattr(t, '_local_tensor')\n", True),
    ("class A(Base):\n    def _run(self):\n        return super()._run()\n", True),
    ("class A:\n    def _run(self):\n        return 1\nclass B(A):\n    def _run(self):\n        return super()._run()\n",
     False),
    ("class A:\n    def __init__(self):\n        self._n = 1\ndef f(a):\n    return a._n\n", False),
    ("import torch\ntorch._foreach_norm([])\nimport os\nos._exit(0)\n", False),
    ("import torch\ntorch.__version__\n", False),
    ("from __future__ import annotations\nimport argparse\ndef f(sub: argparse._SubParsersAction) -> None:\n    pass\n",
     False),  # a type hint never evaluated
    ("import argparse\ndef f(sub: argparse._SubParsersAction) -> None:\n    pass\n", True),
    ("class A:\n    pass\ndef f():\n    made = A()\n    made._pid = 1\n    return made._pid\n", False),
    ("def f(agent):\n    agent._remaining_restarts = 0\n", True),
])
def test_the_scan_itself(source, bad):
    path = PACKAGE / "probe.py"  # never written: only parsed
    tree = ast.parse(source)
    own, members, bases = own_names({path: tree})
    assert bool(reaches(path, tree, own, members, bases)) is bad

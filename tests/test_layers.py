"""The package's layers (DESIGN.md, "Layers"): a module imports only from its own layer or the layers below it.

Every import counts, the lazy ones inside functions included. Every module must be placed in a layer, so a
new module is placed on purpose.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "stabletrain"

#: Top to bottom. A module belongs to the first layer one of whose prefixes is its dotted name or a parent of it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("cli", ("cli", "__main__", "commands")),
    ("integrations", ("integrations",)),
    ("lab, checks, report", ("lab", "checks", "report")),
    ("loop", ("loop",)),
    ("services", ("services", "incident_replay", "remedy_search", "counterfactual", "spike_samples")),
    ("callbacks", ("callbacks",)),
    ("state", ("runstate",)),
    ("strategy", ("distributed",)),
    ("step", ("step", "host_step", "evaluation", "replica")),
    ("diagnostics", ("diagnostics",)),
    ("policies", ("policies",)),
    ("records", ("records",)),
    ("numerics", ("numerics", "syncs")),
    ("config", ("config",)),
    ("tasks", ("tasks", "data")),
    ("base", ("errors", "console", "fileio", "seeding", "internals", "process", "_version")),
]


def layer_of(module: str) -> int | None:
    """The index in :data:`LAYERS` of ``module`` (dotted, without ``stabletrain.``), or None if it has none."""
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return None


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports_of(module: str, path: Path) -> set[str]:
    """The package modules ``module`` imports (dotted, without ``stabletrain.``), from any place in the file."""
    found = set()
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("stabletrain"):
                name = node.module.removeprefix("stabletrain").lstrip(".")
            else:
                continue
            found.update(f"{name}.{a.name}".lstrip(".") for a in node.names)
            found.add(name)
        elif isinstance(node, ast.Import):
            found.update(a.name.removeprefix("stabletrain").lstrip(".") for a in node.names
                         if a.name.split(".")[0] == "stabletrain")
    return {name for name in found if name}


def upward(module: str, imported: set[str], known: set[str]) -> list[str]:
    """The imports of ``module`` that reach a layer above its own."""
    own = layer_of(module)
    return sorted(f"{module} ({LAYERS[own][0]}) imports {name} ({LAYERS[layer_of(name)][0]})"
                  for name in imported if name in known and layer_of(name) is not None and layer_of(name) < own)


def test_every_module_has_a_layer():
    missing = sorted(m for m in _modules() if m and layer_of(m) is None)
    assert not missing, f"modules in no layer (add them to LAYERS in {Path(__file__).name}): {missing}"


def test_no_module_imports_from_a_layer_above_its_own():
    modules = _modules()
    known = set(modules)
    found = [line for module, path in modules.items() if module
             for line in upward(module, imports_of(module, path), known)]
    assert not found, "upward imports:\n" + "\n".join(found)


@pytest.mark.parametrize(("module", "imported", "bad"), [
    ("tasks.gpt", {"diagnostics.initialization"}, True),   # the bottom reaching up
    ("records.incidents", {"distributed.strategy"}, True),
    ("loop", {"services.incidents", "step", "tasks"}, False),
    ("services.incidents", {"incident_replay"}, False),             # one layer
])
def test_the_rule_itself(module, imported, bad, tmp_path):
    assert bool(upward(module, imported, set(_modules()))) is bad
    source = tmp_path / "mod.py"
    source.write_text("def f():\n    from ..diagnostics import initialization\n    from stabletrain.step import build_step\n")
    assert imports_of("tasks.mod", source) >= {"diagnostics", "diagnostics.initialization", "step", "step.build_step"}


def test_no_two_modules_share_a_basename():
    """A module's name says what it does wherever it is imported from: ``remedy``, ``remedies`` and ``replay`` twice
    each made a reader open the wrong file (issue 35). ``__init__`` aside."""
    seen: dict[str, list[str]] = {}
    for module, path in _modules().items():
        if path.name != "__init__.py":
            seen.setdefault(path.stem, []).append(module)
    twice = {name: modules for name, modules in seen.items() if len(modules) > 1}
    assert not twice, f"module names used more than once (give each its role's name): {twice}"


def test_the_basename_rule_itself(tmp_path, monkeypatch):
    for name in ("a/remedy.py", "b/remedy.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", tmp_path)
    with pytest.raises(AssertionError, match="remedy"):
        test_no_two_modules_share_a_basename()


def private_imports(path: Path) -> list[str]:
    """``from X import _name`` in ``path`` where X is a module of the package (relative, or ``stabletrain.``...)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("stabletrain")):
            found += [f"{'.' * node.level}{node.module or ''}:{a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_module_imports_another_modules_private_names():
    """A private name is its module's own: another module that needs it names a public one (issue 35: the replay
    imported the captured module's _sgd_noop; the tasks package the arguments module's _SIMPLE and _checkable)."""
    found = {module: names for module, path in _modules().items() if (names := private_imports(path))}
    assert not found, f"private names imported from another module (make them public, or move the code): {found}"


def test_the_private_import_rule_itself(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text("from .captured import _sgd_noop, build\nfrom stabletrain.tasks import _SIMPLE\n"
                      "from torch.nn import _reduction\nfrom __future__ import annotations\n")
    assert private_imports(source) == [".captured:_sgd_noop", "stabletrain.tasks:_SIMPLE"]


#: The sizes the house keeps (issue 35; DESIGN.md asks for ~400-line modules): past them a module is split by concern.
MAX_MODULE_LINES, MAX_LOOP_LINES, MAX_INTEGRATIONS_LINES = 500, 300, 1200


def test_no_module_outgrows_the_house_sizes():
    """Every module <= 500 lines, the loop <= 300, the adapters (integrations/) <= 1,200 together: the adapters reuse
    the loop's services instead of growing a second trainer."""
    lines = {module: len(path.read_text().splitlines()) for module, path in _modules().items()}
    big = {m: n for m, n in lines.items() if n > MAX_MODULE_LINES}
    assert not big, f"modules over {MAX_MODULE_LINES} lines (split them by concern): {big}"
    assert lines["loop"] <= MAX_LOOP_LINES, lines["loop"]
    adapters = sum(n for m, n in lines.items() if m == "integrations" or m.startswith("integrations."))
    assert adapters <= MAX_INTEGRATIONS_LINES, adapters

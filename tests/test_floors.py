"""The declared floors (pyproject.toml: requires-python, torch) cover what the code uses, and run.

The static test reads the source for APIs newer than a floor (each with the version that brought it);
an API behind a guard that names the version it needs is listed as guarded. The run on the floor needs
an interpreter at the Python floor with torch installed: ``STABLETRAIN_FLOOR_PYTHON=/path/to/python``,
else a ``python3.10`` on PATH that imports torch; without one it is skipped, saying so.
"""

import ast
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
SRC = ROOT / "src" / "stabletrain"

# (what the source shows, how to find it, the floor it needs)
PYTHON_APIS = [
    ("BaseException.add_note", re.compile(r"\.add_note\("), (3, 11)),
    ("hashlib.file_digest", re.compile(r"\bfile_digest\("), (3, 11)),
    ("tomllib", re.compile(r"^\s*(import|from) tomllib\b", re.M), (3, 11)),
    ("ExceptionGroup / except*", re.compile(r"\bExceptionGroup\b|^\s*except\s*\*", re.M), (3, 11)),
    ("typing.Self / Never / NotRequired", re.compile(r"from typing import[^\n]*\b(Self|Never|NotRequired|Required)\b"),
     (3, 11)),
    ("enum.StrEnum", re.compile(r"\bStrEnum\b"), (3, 11)),
]
TORCH_APIS = [
    ("torch.nn.utils.get_total_norm", re.compile(r"\bget_total_norm\("), (2, 6)),
    ("torch.nn.utils.clip_grads_with_norm_", re.compile(r"\bclip_grads_with_norm_\("), (2, 6)),
    ("torch.distributed.fsdp.fully_shard (public)", re.compile(r"from torch\.distributed\.fsdp import[^\n]*fully_shard"),
     (2, 6)),
    ("DCP DefaultStager / async_save(async_stager=)", re.compile(r"\bDefaultStager\b"), (2, 9)),
]
#: APIs behind a guard that raises a clear error on an older torch (the file that holds the guard).
GUARDED = {"DCP DefaultStager / async_save(async_stager=)": "shards.py"}


def _floor(spec: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.search(r">=\s*([\d.]+)", spec).group(1).split("."))


def _declared():
    text = (ROOT / "pyproject.toml").read_text()
    python = _floor(re.search(r'requires-python\s*=\s*"([^"]+)"', text).group(1))
    torch_floor = _floor(re.search(r'"torch(>=[^"]+)"', text).group(1))
    return python, torch_floor


def _code(path: Path) -> str:
    """The file's code without its docstrings and comments (what a mention in prose says does not count)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body[0] = ast.Pass()
    return ast.unparse(tree)


def test_the_declared_floors_cover_every_api_the_code_uses():
    python, torch_floor = _declared()
    sources = {p: _code(p) for p in SRC.rglob("*.py")}
    too_new = []
    for apis, floor, what in ((PYTHON_APIS, python, "Python"), (TORCH_APIS, torch_floor, "torch")):
        for name, pattern, needs in apis:
            users = [p.relative_to(SRC) for p, code in sources.items() if pattern.search(code)]
            guarded = GUARDED.get(name)
            if users and needs > floor and not (guarded and all(p.name == guarded for p in users)):
                too_new.append(f"{name} needs {what} {'.'.join(map(str, needs))} (declared "
                               f"{'.'.join(map(str, floor))}): used in {', '.join(map(str, users))}")
    assert not too_new, "\n".join(too_new)
    assert python >= (3, 10) and torch_floor >= (2, 6)


def _floor_python():
    """An interpreter at the declared Python floor that imports torch, or None."""
    python, _ = _declared()
    candidates = [os.environ.get("STABLETRAIN_FLOOR_PYTHON"), shutil.which(f"python{python[0]}.{python[1]}")]
    for exe in filter(None, candidates):
        res = subprocess.run([exe, "-c", "import sys, torch; print(sys.version_info[:2] == %r)" % (python,)],
                             capture_output=True, text=True, timeout=120)
        if res.returncode == 0 and res.stdout.strip() == "True":
            return exe
    return None


def test_on_the_python_floor_a_crash_with_a_run_directory_is_one_clear_error_with_the_note(tmp_path):
    exe = _floor_python()
    if exe is None:
        pytest.skip("no interpreter at the declared Python floor with torch (set STABLETRAIN_FLOOR_PYTHON)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(TESTS)]), "OMP_NUM_THREADS": "1"}
    run_dir = tmp_path / "run"
    res = subprocess.run([exe, "-m", "stabletrain", "train", "task=user_code_tasks:bad_forward_task",
                          "train.max_steps=3", "log.progress=false", "log.tensorboard=false", f"run.dir={run_dir}"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 1, res.stderr[-3000:]
    assert "AttributeError" not in res.stderr, res.stderr[-3000:]
    assert "stabletrain: error: the task's model forward raised RuntimeError" in res.stderr
    assert f"(recorded in {run_dir}; see: stabletrain report {run_dir})" in res.stderr
    ok = subprocess.run([exe, "-m", "stabletrain", "train", "task=mlp", "train.max_steps=4", "log.every=2",
                         "log.progress=false", "log.tensorboard=false", f"run.dir={tmp_path / 'ok'}"],
                        capture_output=True, text=True, env=env, timeout=300)
    assert ok.returncode == 0 and "trained 4 steps" in ok.stdout, ok.stderr[-3000:]

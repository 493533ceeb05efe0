"""The gpt task's data: the stdlib's sources found in sorted path order without walking the whole tree first."""

from __future__ import annotations

import os

from stabletrain.tasks.gpt import _sorted_py_files


def test_the_sources_come_in_the_order_of_sorted_rglob_with_packages_and_symlinked_dirs_left_out(tmp_path):
    files = ["a.py", "a/x.py", "a-b.py", "a_b/y.py", "B.py", "b.py", "z/deep/er/w.py", "pkg.py/inner.py",
             "site-packages/no.py", "z/dist-packages/no.py", "c.txt", "c.pyc", ".py", "a/site-packages.py"]
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    os.symlink(tmp_path / "a", tmp_path / "linked")  # rglob does not enter a symlinked directory
    want = sorted(p for p in tmp_path.rglob("*.py") if not {"site-packages", "dist-packages"} & set(p.parts))
    got = list(_sorted_py_files(tmp_path))
    assert got == want
    assert [p.relative_to(tmp_path).as_posix() for p in got] == [
        ".py", "B.py", "a/site-packages.py", "a/x.py", "a-b.py", "a.py", "a_b/y.py", "b.py", "pkg.py", "pkg.py/inner.py",
        "z/deep/er/w.py"]

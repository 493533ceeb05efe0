"""atomic_write: the new content or the old, never half, and no temporary file left behind."""

from __future__ import annotations

import os

import pytest

from stabletrain.fileio import atomic_write


@pytest.mark.parametrize("data, expect", [
    (b"\x00bytes\xff", b"\x00bytes\xff"),
    ("text ü\n", "text ü\n".encode()),
    (lambda fh: (fh.write(b"from "), fh.write(b"a writer")), b"from a writer"),
])
def test_writes_the_content_and_leaves_no_temporary_file(tmp_path, data, expect):
    path = tmp_path / "file.txt"
    path.write_text("old")
    assert atomic_write(path, data) == path
    assert path.read_bytes() == expect
    assert os.listdir(tmp_path) == ["file.txt"]
    atomic_write(tmp_path / "new.bin", b"x", fsync=False)  # a new file; no fsync: still atomic
    assert sorted(os.listdir(tmp_path)) == ["file.txt", "new.bin"]


def test_a_failing_writer_leaves_the_old_file_intact(tmp_path):
    path = tmp_path / "state.bin"
    path.write_bytes(b"old content")

    def dies_halfway(fh):
        fh.write(b"half of the new")
        raise RuntimeError("disk went away")

    with pytest.raises(RuntimeError, match="disk went away"):
        atomic_write(path, dies_halfway)
    assert path.read_bytes() == b"old content"
    assert os.listdir(tmp_path) == ["state.bin"]


def test_a_failing_fsync_leaves_the_old_file_intact(tmp_path, monkeypatch):
    path = tmp_path / "LAST_GOOD"
    path.write_text("step_000001\n")

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        atomic_write(path, "step_000002\n")
    assert path.read_text() == "step_000001\n" and os.listdir(tmp_path) == ["LAST_GOOD"]


def test_the_temporary_file_is_in_the_same_directory(tmp_path):
    seen = []
    atomic_write(tmp_path / "out.json", lambda fh: seen.append(fh.name))
    assert seen == [str(tmp_path / f"out.json.tmp-{os.getpid()}")]  # same filesystem: the rename is atomic

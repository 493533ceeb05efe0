"""Faults planted in the checkpoint writer process by tests: this directory goes first on its PYTHONPATH.

``STABLETRAIN_TEST_WRITER_FAULT="KIND:ARG"``, read when a Python process starts; only the writer process
(``python -m stabletrain.records.checkpoint.writer_main``) acts on it, so a training process started with the
same environment is untouched:

* ``enospc:PATTERN``  ``os.fsync`` of a file whose path matches PATTERN (fnmatch) raises ENOSPC (a full disk);
* ``die:PATTERN``     ``os.fsync`` of such a file SIGKILLs the writer (it dies mid-save);
* ``hold:DIR:NAME``   before checkpoint NAME's (e.g. step_000002) temporary directory is renamed into place
  (written and verified, LAST_GOOD not moved yet) the writer writes its pid to DIR/reached and waits for
  DIR/release (up to 120 s);
* ``slow:DIR``        the writer's start (its imports) takes until DIR/release exists (up to 120 s).
"""

import os
import sys

_FAULT = os.environ.get("STABLETRAIN_TEST_WRITER_FAULT", "")
if _FAULT and "stabletrain.records.checkpoint.writer_main" in getattr(sys, "orig_argv", ()):
    import errno
    import fnmatch
    import signal
    import time

    kind, _, arg = _FAULT.partition(":")
    if kind in ("enospc", "die"):
        real_fsync = os.fsync

        def fsync(fd):
            path = os.readlink(f"/proc/self/fd/{fd}")
            if fnmatch.fnmatch(path, arg):
                if kind == "die":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_fsync(fd)

        os.fsync = fsync
    elif kind == "hold":
        real_replace = os.replace
        arg, _, held = arg.rpartition(":")

        def replace(src, dst, *a, **k):
            name = os.path.basename(os.fspath(src))
            if name.startswith(held + ".tmp-") and os.path.isdir(src):
                with open(os.path.join(arg, "reached.tmp"), "w") as fh:
                    fh.write(str(os.getpid()))
                real_replace(os.path.join(arg, "reached.tmp"), os.path.join(arg, "reached"))
                deadline = time.time() + 120
                while not os.path.exists(os.path.join(arg, "release")) and time.time() < deadline:
                    time.sleep(0.01)
            return real_replace(src, dst, *a, **k)

        os.replace = replace
    elif kind == "slow":
        deadline = time.time() + 120
        while not os.path.exists(os.path.join(arg, "release")) and time.time() < deadline:
            time.sleep(0.01)
    else:
        raise SystemExit(f"STABLETRAIN_TEST_WRITER_FAULT: unknown kind {kind!r}")

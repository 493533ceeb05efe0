import os
import subprocess
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# One torch thread per process, here and in every process a test starts (before torch is imported in either):
# the two xdist workers and their children already fill the CI machine's two cores, and intra-op threads that
# compete for them spin. Measured on the 2-core machine under load: test_my_task_learns_its_rule_in_300_steps
# took 24.0 CPU-s with 2 threads, 8.6 with 1. A value already set is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")


#: The files that take longest (a whole run's test durations, summed per file: SIGKILL + resume, torchrun
#: worlds, the CLI in fresh processes, the trackers), handed out first. The test command runs two pytest-xdist
#: workers, a whole file at a time (``--dist loadfile``: a module's fixtures run once); the longest first keeps
#: one worker from starting a long file when the other is nearly done. From a whole run on the 2-core machine
#: (2026-12-07, three workers, CPU-s summed per file): test_restarts 343, test_distributed 131, test_resume 119,
#: test_checkpoint_writer 113, test_trackers 76, test_cli 73, test_fsdp_checkpoint 73, test_lab 60, test_compile 49,
#: test_console 45, test_adapters_distributed 45, test_report 44, test_integrations_transformers 39, ...
LONGEST_FIRST = ["test_restarts.py", "test_distributed.py", "test_resume.py", "test_checkpoint_writer.py", "test_trackers.py",
                 "test_cli.py", "test_fsdp_checkpoint.py", "test_spikes.py", "test_lab.py", "test_compile.py", "test_console.py",
                 "test_adapters_distributed.py", "test_report.py", "test_integrations_transformers.py", "test_fsdp.py",
                 "test_fsdp_incidents.py", "test_restart_exhausted.py", "test_remedy_live.py", "test_reshard.py",
                 "test_check_resume.py", "test_integrations_readme.py", "test_errors.py", "test_monitor.py",
                 "test_bench_fsdp.py", "test_guard.py", "test_goodput_crash.py", "test_late_sigterm.py", "test_internals.py",
                 "test_loop.py", "test_incident_once.py"]


@pytest.hookimpl(tryfirst=True)  # before xdist reads the order
def pytest_collection_modifyitems(config, items):
    import torch

    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order is kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _temporary_files_under_pytests_folder(tmp_path_factory):
    """Every temporary file of the suite's processes (a launcher's run-directory note that a test's SIGKILL leaves behind,
    torchrun's agent folders, a tracker's media) goes under pytest's own folder, which pytest prunes to its last three
    runs: a machine that runs the suite many times a day must not fill its disk with them (one did: the CI run that
    followed failed, "could not create numbered dir")."""
    folder, before = tmp_path_factory.mktemp("tmp"), os.environ.get("TMPDIR")
    # torch.compile's cache stays where it was (under the temporary folder by default): compiled tests keep a warm cache
    import getpass

    cache = "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    if cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    os.environ["TMPDIR"], tempfile.tempdir = str(folder), None
    yield
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
    if cache:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    tempfile.tempdir = None


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs mounted for the test (root only); skipped where it cannot be mounted."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    try:
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount_point)], capture_output=True,
                             text=True, timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired) as err:
        pytest.skip(f"cannot mount a tmpfs here ({err}); the RLIMIT_FSIZE test covers a failing save")
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({(res.stderr or res.stdout).strip()}, exit {res.returncode}); the "
                    "RLIMIT_FSIZE test covers a failing save")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, timeout=30)

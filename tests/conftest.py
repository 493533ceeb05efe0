import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


#: The files that take longest (a whole run's test durations, summed per file: torchrun worlds, SIGKILL +
#: resume, the labs, the CLI in fresh processes), handed out first. The test command runs two pytest-xdist
#: workers, a whole file at a time (``--dist loadfile``: a module's fixtures run once); the longest first keeps
#: one worker from starting a long file when the other is nearly done.
LONGEST_FIRST = ["test_fsdp.py", "test_distributed.py", "test_lab.py", "test_resume.py", "test_cli.py",
                 "test_trackers.py", "test_fsdp_checkpoint.py", "test_adapters_hosts.py", "test_loop.py",
                 "test_errors.py", "test_reshard.py", "test_console.py", "test_report.py",
                 "test_adapters_distributed.py", "test_compile.py"]


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

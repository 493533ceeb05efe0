import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


#: The files that take longest (torchrun worlds, SIGKILL + resume, inductor compiles), handed out first. The
#: test command runs two pytest-xdist workers, a whole file at a time (``--dist loadfile``: a module's fixtures
#: run once); the longest first keeps one worker from starting a long file when the other is nearly done.
LONGEST_FIRST = ["test_fsdp.py", "test_distributed.py", "test_fsdp_checkpoint.py", "test_compile.py",
                 "test_adapters_distributed.py", "test_resume.py", "test_integrations_transformers.py",
                 "test_reshard.py", "test_trackers.py", "test_bench_fsdp.py", "test_report.py"]


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

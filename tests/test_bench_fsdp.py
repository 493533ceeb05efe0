"""bench/fsdp.py's overhead part: the two loops it times do the same work, and its collective counter counts.

One ``--quick`` run (a 2-layer gpt, 2 rounds under torchrun, gloo): the timings mean nothing here, the
checks that make them comparable do.
"""

import re
import sys
from pathlib import Path

import pytest
from multiproc import run

pytestmark = pytest.mark.slow  # a 2-process torchrun job

BENCH = Path(__file__).resolve().parents[1] / "bench" / "fsdp.py"


@pytest.fixture(scope="module")
def quick_overhead():
    return run([sys.executable, str(BENCH), "--quick", "--parts", "overhead"], timeout=400).stdout


def test_the_trainer_and_the_hand_written_fsdp2_loop_end_with_the_same_parameters(quick_overhead):
    # Same init, same batches on the same rank at the same step, constant lr: the shards agree after every
    # round to float rounding (the two global norms are summed in different orders), far inside 1e-4.
    diffs = [float(x) for x in re.findall(r"max \|shard difference\| ([0-9.e+-]+)  \[", quick_overhead)]
    assert len(diffs) == 2, quick_overhead
    assert all(d < 1e-5 for d in diffs), diffs
    ratio = re.search(r"stabletrain Trainer, fsdp\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)", quick_overhead)
    assert ratio is not None and float(ratio.group(3)) > 0, quick_overhead


def test_the_collective_counter_sees_fsdp2s_gathers_and_scatters_and_dtensors_all_reduce(quick_overhead):
    # The bare loop on 2 blocks + the root (3 FSDP units, torch's defaults): each block gathered for forward
    # and again for backward, the root once (not resharded after forward), one reduce-scatter per unit, and
    # clip_grad_norm_'s DTensor norm: one all-reduce through functional collectives, not dist.all_reduce.
    line = re.search(r"collectives per step: bare ([^;]+);", quick_overhead)
    assert line is not None, quick_overhead
    counts = {k: int(v) for k, v in (item.rsplit(" ", 1) for item in line.group(1).split(", ")) if int(v)}
    assert counts == {"all_gather": 5, "all_reduce": 1, "reduce_scatter": 3}

"""capture.memory_snapshot=auto: the incident snapshot is taken when the state fits the host-memory budget, else off
with one line."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from helpers import cfg, nan_sample_task

from stabletrain import Trainer
from stabletrain.records.snapshot import IntervalSnapshot, order_steps_after
from stabletrain.records.staging import snapshot_fits, state_bytes

MIB = 2 ** 20


def test_the_budget_is_a_fraction_of_the_available_memory_for_every_process_on_the_host():
    # 100 MiB per process; 3 GiB available x 0.25 = 768 MiB: 7 processes fit (700), 8 do not (800).
    assert snapshot_fits(100 * MIB, 0.25, processes=7, available=3072 * MIB) == (True, 768 * MIB)
    assert snapshot_fits(100 * MIB, 0.25, processes=8, available=3072 * MIB) == (False, 768 * MIB)
    w = torch.zeros(10, 4)  # 160 bytes, tied: counted once
    state = {"model": {"a": w, "b": w, "c": torch.zeros(5, dtype=torch.float64)}, "step": 3}
    assert state_bytes(state) == 160 + 40
    assert state_bytes(state, share=3) == 67  # DDP: a third each, rounded up


@pytest.mark.parametrize("fraction, replayed, lines", [(1e-9, 13, 1), (0.25, 3, 0)])
def test_auto_turns_the_snapshot_off_with_one_line_when_the_state_exceeds_the_budget(tmp_path, capsys, fraction,
                                                                                       replayed, lines):
    # Sample 107 is in step 14 (8 per step, in order), the last checkpoint at step 0: from the interval's snapshot
    # the capture replays steps 11-13; with the snapshot off it replays from LAST_GOOD, steps 1-13.
    c = cfg("train.batch_size=8", "train.max_steps=15", "log.every=5", "capture.diagnose=false", "data.shuffle=false",
            f"capture.snapshot_memory_fraction={fraction}")
    assert c.capture.memory_snapshot == "auto"  # the default
    trainer = Trainer(c, task=nan_sample_task(bad_index=107, n=128), run_dir=tmp_path / "run")
    trainer.fit()
    said = [x for x in capsys.readouterr().err.splitlines() if "capture.memory_snapshot" in x]
    assert len(said) == lines
    if lines:
        assert said[0].startswith("stabletrain: warning: capture.memory_snapshot=auto: the incident snapshot is off: ")
        assert "x 1 process(es) on this host exceed capture.snapshot_memory_fraction=1e-09" in said[0]
        assert "replays from the last checkpoint (LAST_GOOD, up to ckpt.every=100 steps)" in said[0]
        assert trainer.recorder.snapshot is None
    else:
        assert trainer.recorder.snapshot is not None
    assert trainer.recorder.replayed_steps == replayed
    assert (tmp_path / "run" / "incidents" / "step_000014" / "bundle.pt").is_file()


@pytest.mark.gpu
def test_on_cuda_the_parameters_are_copied_on_a_side_stream_the_optimizer_step_waits_for():
    model = torch.nn.Linear(64, 64, device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(8, 64, device="cuda")).sum().backward()
    opt.step()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    snapshot = IntervalSnapshot()
    snapshot.take({"model": dict(model.named_parameters()), "optimizer": opt.state_dict()["state"]}, {"step": 1}, 1,
                  optimizer=opt)
    assert snapshot._stream is not None and snapshot._stream != torch.cuda.current_stream()
    assert snapshot._events and snapshot._ordered is False  # queued on the side stream; nothing waited for it yet
    opt.step()  # its pre-hook makes the compute stream wait for the copies before it writes the parameters
    assert snapshot._ordered is True
    side, rest = snapshot.get()
    for name, value in before.items():
        assert side["model"][name].device.type == "cpu" and torch.equal(side["model"][name], value.cpu()), name
    assert rest == {"step": 1}


def test_the_optimizers_pre_hook_orders_the_snapshot_only_while_the_snapshot_lives():
    """A user's optimizer outlives a Monitor and its snapshot: the hook must not keep the snapshot's host copy alive."""
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snapshot = IntervalSnapshot()
    order_steps_after(opt, snapshot)
    snapshot._ordered = False  # as after a take on CUDA: copies queued, the next step must wait for them
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    assert snapshot._ordered is True
    alive = weakref.ref(snapshot)
    del snapshot
    gc.collect()
    assert alive() is None  # the optimizer's hook held it weakly
    opt.step()  # and the hook went with it (a step after is no error)

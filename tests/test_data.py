"""The data path: seeded epoch orders, rank shards that tile the global batch, windows within an epoch."""

import torch
from torch.utils.data import TensorDataset

from stabletrain.data import EpochOrder, WindowStream


def test_rank_shards_tile_the_single_process_batches():
    one = EpochOrder(50, batch_size=8, seed=3, world_size=1)
    ranks = [EpochOrder(50, batch_size=4, seed=3, rank=r, world_size=2) for r in range(2)]
    for epoch in range(2):
        big = one.micro_batches(epoch)
        parts = [r.micro_batches(epoch) for r in ranks]
        assert len(big) == len(parts[0]) == len(parts[1]) == 7
        for b, p0, p1 in zip(big, *parts):
            assert p0 + p1 == b
    assert one.micro_batches(0) != one.micro_batches(1)
    assert one.micro_batches(1) == EpochOrder(50, 8, seed=3).micro_batches(1)  # a pure function of (seed, epoch)
    assert EpochOrder(50, 8, seed=4).micro_batches(0) != one.micro_batches(0)


def test_windows_stay_in_the_epoch_and_resume_exactly():
    data = TensorDataset(torch.arange(30).float())
    order = EpochOrder(30, batch_size=4, seed=0)  # 8 micro-batches per epoch (last has 2 samples)
    stream = WindowStream(data, order, accum_steps=3)
    sizes = []
    seen = []
    for _ in range(6):
        w = stream.next_window()
        sizes.append((w.epoch, len(w.indices), w.num_samples))
        seen.append(w)
    assert sizes == [(0, 3, 12), (0, 3, 12), (0, 2, 6), (1, 3, 12), (1, 3, 12), (1, 2, 6)]
    assert sorted(i for w in seen[:3] for idx in w.indices for i in idx) == list(range(30))
    # Batches match their indices.
    for w in seen:
        for idx, batch in zip(w.indices, w.batches):
            assert batch[0].long().tolist() == idx
    # Resume from a saved position: the same windows, without iterating through the skipped ones.
    fresh = WindowStream(data, order, accum_steps=3)
    stream2 = WindowStream(data, order, accum_steps=3)
    for _ in range(4):
        stream2.next_window()
    fresh.load_state_dict(stream2.state_dict())
    for expected in seen[4:]:
        got = fresh.next_window()
        assert (got.epoch, got.start, got.indices) == (expected.epoch, expected.start, expected.indices)

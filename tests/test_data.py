"""The data path: seeded epoch orders, rank shards that tile the global batch, windows within an epoch."""

import pytest
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


def test_an_epoch_tail_shorter_than_the_ranks_is_dropped_and_said_once_by_rank_0(capsys):
    """65 samples, 2 ranks of batch 4: the last sample cannot go to every rank and is not trained on (one process
    would); a new user's DDP run lost it every epoch without a word. Rank 0 says it, once a run."""
    ranks = [EpochOrder(65, batch_size=4, seed=0, rank=r, world_size=2) for r in range(2)]
    for epoch in range(2):
        parts = [r.micro_batches(epoch) for r in ranks]
        assert sum(len(b) for p in parts for b in p) == 64 and len(parts[0]) == 8
    err = capsys.readouterr().err
    assert err == ("stabletrain: warning: data: the last 1 sample(s) of epoch 0 are not trained on: fewer than the 2 ranks, "
                   "each of which needs one (so at the end of every epoch whose tail is that short; one process would "
                   "train on them)\n"), err
    EpochOrder(67, batch_size=4, seed=0, rank=0, world_size=2).micro_batches(0)  # 3 left: split 1 / 2, none dropped
    assert capsys.readouterr().err == ""


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


# -- a position saved under one layout, continued under another (a resharded resume) ---------------


def _global_steps(streams, steps):
    """The samples of each of the next ``steps`` windows over all ranks: micro-batch by micro-batch, rank by rank."""
    out = []
    for _ in range(steps):
        windows = [s.next_window() for s in streams]
        out.append((windows[0].epoch, [i for m in range(len(windows[0].indices)) for w in windows for i in w.indices[m]]))
    return out


def _streams(n, batch, world, accum, seed=5):
    data = TensorDataset(torch.arange(n).float())
    return [WindowStream(data, EpochOrder(n, batch, seed, rank=r, world_size=world), accum) for r in range(world)]


def test_a_position_saved_by_2_ranks_continues_on_1_with_the_same_samples_step_by_step():
    # 60 samples, 2 ranks x 4 x accum 1 (8 per step, tail 4) against 1 rank x 4 x accum 2 (8 per step, tail 4).
    straight = _global_steps(_streams(60, 4, 2, 1), 20)
    for cut in (0, 3, 7, 8, 11):  # mid-epoch, the epoch's last window, an epoch boundary, mid-epoch 1
        two = _streams(60, 4, 2, 1)
        _global_steps(two, cut)
        one = _streams(60, 4, 1, 2)
        one[0].load_state_dict(two[0].state_dict())
        assert _global_steps(one, 20 - cut) == straight[cut:], cut
    two = _streams(60, 4, 2, 1)
    _global_steps(two, 3)
    one = _streams(60, 4, 1, 2)[0]
    one.load_state_dict(two[1].state_dict())  # any rank's position: the same global offset
    assert (one.epoch, one.pos, one.origin, one.sample_offset()) == (0, 0, 24, 24)


def test_a_position_saved_by_1_rank_continues_on_2_ranks_and_the_next_epoch_starts_at_0():
    straight = _global_steps(_streams(60, 8, 1, 1), 12)
    one = _streams(60, 8, 1, 1)
    _global_steps(one, 5)
    two = _streams(60, 2, 2, 2)  # 2 ranks x 2 x accum 2: 8 per step
    for s in two:
        s.load_state_dict(one[0].state_dict())
    assert _global_steps(two, 7) == straight[5:]
    assert two[0].state_dict()["origin"] == 0 and two[0].epoch == 1  # epoch 1 is cut from sample 0


def test_a_saved_position_past_the_epochs_last_micro_batch_continues_in_the_next_epoch():
    # 57 samples on 2 ranks x 4: 7 chunks of 8, the last sample is dropped (fewer than 2). Under 1 rank it stays dropped.
    two = _streams(57, 4, 2, 1)
    _global_steps(two, 7)
    assert two[0].sample_offset() == 57
    one = _streams(57, 8, 1, 1)[0]
    one.load_state_dict(two[0].state_dict())
    window = one.next_window()
    assert (window.epoch, window.start) == (1, 0)


def test_skipped_windows_of_the_old_layout_skip_every_new_window_that_shares_a_sample():
    two = _streams(60, 4, 2, 1)
    _global_steps(two, 2)  # at global micro-batch 2 (sample 16)
    state = {**two[0].state_dict(), "skip": [(0, 0), (0, 4), (1, 1)]}  # behind; samples 32..39; epoch 1 samples 8..15
    one = _streams(60, 3, 1, 2)[0]  # 1 rank x 3 x accum 2: windows of 6 samples from sample 16
    one.load_state_dict(state)
    # epoch 0 from 16: windows [16,22) [22,28) [28,34) [34,40) ...: 32..39 lies in the 3rd and 4th (starts 4 and 6)
    # epoch 1 from 0: [0,6) [6,12) [12,18): 8..15 lies in the 2nd and 3rd (starts 2 and 4)
    assert one.skip == {(0, 4), (0, 6), (1, 2), (1, 4)}
    seen = _global_steps([one], 9)
    trained = {i for e, idx in seen if e == 0 for i in idx}
    order = EpochOrder(60, 3, 5).order(0)
    assert not trained & set(order[32:40].tolist()) and set(order[16:28].tolist()) <= trained


def test_a_tensor_dataset_is_gathered_bitwise_as_the_dataloader_collates_it():
    """A TensorDataset with torch's own collate is read by one gather per tensor, not a DataLoader: the same
    batches, bitwise (types, dtypes, shapes, strides), over epochs, a short last micro-batch and dropped samples."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(37, 3, 2, generator=g).transpose(1, 2), torch.randint(0, 9, (37,), generator=g),
                         torch.randn(37, generator=g).double())
    order = EpochOrder(37, batch_size=5, seed=1)
    fast = WindowStream(data, order, accum_steps=2)
    slow = WindowStream(data, order, accum_steps=2, collate=torch.utils.data.default_collate)  # the DataLoader path
    assert fast._tensors is not None and slow._tensors is None
    fast.drop = slow.drop = {4, 11}
    for _ in range(12):  # 8 micro-batches an epoch (the last of 2 samples): three epochs
        a, b = fast.next_window(), slow.next_window()
        assert (a.epoch, a.start, a.indices) == (b.epoch, b.start, b.indices)
        for x, y in zip(a.batches, b.batches):
            assert type(x) is type(y) is list and len(x) == len(y) == 3
            for u, v in zip(x, y):
                assert u.dtype == v.dtype and u.shape == v.shape and u.stride() == v.stride() and torch.equal(u, v)
    assert not isinstance(fast._iter, torch.utils.data.dataloader._BaseDataLoaderIter)


def test_dropped_samples_under_ddp_keep_every_rank_in_step_and_count_the_global_window():
    """A rollback's named samples, dropped under 2 ranks: each rank weighs every rank's share from the epoch's order
    (no collective), so both count the window's global samples alike; where a rank would keep nothing of a micro-batch
    (no forward for the gradient all-reduce), both read past the whole window."""
    ds = TensorDataset(torch.arange(64).float()[:, None])
    order = EpochOrder(64, 4, seed=0, shuffle=True, rank=0, world_size=2)
    streams = [WindowStream(ds, EpochOrder(64, 4, seed=0, shuffle=True, rank=r, world_size=2), 2) for r in (0, 1)]
    two_of_rank_1, all_of_rank_0 = order.shares(0, 0)[1][:2], order.shares(0, 2)[0]
    for s in streams:
        s.drop = {*two_of_rank_1, *all_of_rank_0}
    first, second = ([s.next_window() for s in streams] for _ in range(2))
    assert [w.start for w in first] == [0, 0] and [w.global_num_samples for w in first] == [14, 14]
    assert first[0].indices == order.shares(0, 0)[0:1] + order.shares(0, 1)[0:1]  # rank 0 keeps its own
    assert first[1].indices[0] == [i for i in order.shares(0, 0)[1] if i not in two_of_rank_1]
    assert [w.start for w in second] == [4, 4] and [w.global_num_samples for w in second] == [16, 16]  # 2-3 read past


def test_a_stream_with_every_sample_dropped_says_so_instead_of_reading_past_windows_forever():
    """A review: next_window read past empty windows and rolled over epochs without end when drop held every sample."""
    data = TensorDataset(torch.arange(12.0))
    stream = WindowStream(data, EpochOrder(12, batch_size=4, seed=0), accum_steps=1)
    stream.drop = set(range(11))  # one sample left: its window, epoch after epoch
    assert [stream.next_window().indices for _ in range(2)] == [[[11]], [[11]]]
    stream.drop = set(range(12))
    with pytest.raises(ValueError, match=r"^data: no window of epochs 2-4 is left to train on once the 12 dropped "):
        stream.next_window()
    # From the middle of an epoch, the one sample left is behind the position: the next epoch has it (a review: the
    # guard counted windows read past from mid-epoch and raised before reaching it)
    shuffled = WindowStream(data, EpochOrder(12, batch_size=1, seed=0), accum_steps=1)
    order = [shuffled.next_window().indices[0][0] for _ in range(12)]
    late = WindowStream(data, EpochOrder(12, batch_size=1, seed=0), accum_steps=1)
    for _ in range(6):
        late.next_window()
    late.drop = set(range(12)) - {order[2]}
    assert late.next_window().indices == [[order[2]]]


def test_an_epoch_that_gives_no_window_is_no_error_while_a_later_one_can():
    """A review: the guard raised as soon as one whole epoch gave no window, though the rest of the epoch was a
    rollback's skipped window, or a rank's share of one micro-batch was dropped (every rank reads past that window), and
    the next epoch, reshuffled, trains on the samples left."""
    data = TensorDataset(torch.arange(4.0).unsqueeze(1))
    order = EpochOrder(4, batch_size=2, seed=0, shuffle=True)
    first = order.micro_batches(0)
    stream = WindowStream(data, order, accum_steps=1)
    stream.skip, stream.drop = {(0, 0)}, set(first[1])  # one window a rollback skips, the other's samples dropped
    left = sorted(set(range(4)) - set(first[1]))
    window = stream.next_window()
    assert window.epoch == 1 and sorted(i for b in window.indices for i in b) in ([left[0]], [left[1]], left)

    ranked = EpochOrder(4, batch_size=1, seed=0, shuffle=True, rank=0, world_size=2)  # DDP: one sample per rank
    shares = [ranked.shares(0, b) for b in range(2)]  # [[rank 0's], [rank 1's]] of each global micro-batch
    ddp = WindowStream(data, ranked, accum_steps=1)
    ddp.drop = {shares[0][0][0], shares[1][0][0]}  # rank 0's sample of each window: epoch 0 gives none
    window = ddp.next_window()
    assert window.epoch >= 1 and not set(window.indices[0]) & ddp.drop


class _Augmented(torch.utils.data.Dataset):
    """Each item drawn at fetch time (an augmentation): torch's and numpy's streams."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        import numpy as np

        return torch.full((2,), float(i)) + torch.rand(2) + float(np.random.rand())


def test_with_workers_a_resumed_stream_fetches_the_same_augmented_samples_bitwise():
    """A review: the workers' streams were seeded once per loader, built over the rest of the epoch: a resume (or a
    rollback, a replay) from another position handed each batch to another worker, its draws other. Now each sample is
    seeded by (seed, epoch, index): the same values from any position, under any number of workers, with drop too."""
    def stream(workers, drop=(), data=None):
        s = WindowStream(data or _Augmented(), EpochOrder(24, batch_size=4, seed=3), accum_steps=1, workers=workers)
        s.drop = set(drop)
        return s

    class Batched(_Augmented):  # fetched a micro-batch at once (a Hugging Face dataset's __getitems__)
        def __getitems__(self, indices):
            return [self[i] for i in indices]

    # torch's Subset (random_split's) defines __getitems__ too: still seeded per sample, whatever its micro-batch
    subset = torch.utils.data.Subset(_Augmented(), list(range(24)))
    by_4 = WindowStream(subset, EpochOrder(24, batch_size=4, seed=3, shuffle=False), accum_steps=1, workers=1)
    by_6 = WindowStream(subset, EpochOrder(24, batch_size=6, seed=3, shuffle=False), accum_steps=1, workers=1)
    assert torch.equal(torch.cat([by_4.next_window().batches[0] for _ in range(3)]),
                       torch.cat([by_6.next_window().batches[0] for _ in range(2)]))
    a, b = stream(2, data=Batched()), stream(1, data=Batched())
    for _ in range(2):
        a.next_window()
    b.load_state_dict(a.state_dict())
    again = stream(2, data=Batched())
    [again.next_window() for _ in range(2)]
    assert torch.equal(again.next_window().batches[0], b.next_window().batches[0])  # its draws seeded per micro-batch

    whole = stream(2)
    first = [whole.next_window() for _ in range(8)]  # into the second epoch
    part = stream(2)
    for _ in range(3):
        part.next_window()
    resumed = stream(1)
    resumed.load_state_dict(part.state_dict())
    for a, b in zip(first[3:], [resumed.next_window() for _ in range(5)]):
        assert (a.epoch, a.start, a.indices) == (b.epoch, b.start, b.indices) and torch.equal(a.batches[0], b.batches[0])
    dropped = stream(2, drop=[first[0].indices[0][1]])  # a sample of the first window left out: the rest re-collated
    w = dropped.next_window()
    assert torch.equal(w.batches[0], first[0].batches[0][[0, 2, 3]])

"""seeding.kept_rng: every RNG stream is put back after the block, also when it raises."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from stabletrain.seeding import kept_rng, seed_everything, set_rng_state


def _draw() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def test_kept_rng_puts_every_stream_back():
    seed_everything(3)
    expected = _draw()
    seed_everything(3)
    with kept_rng():
        _draw()
        seed_everything(99)  # a block that sets a state of its own
        _draw()
    assert _draw() == expected


def test_kept_rng_puts_every_stream_back_after_an_exception():
    seed_everything(5)
    expected = _draw()
    seed_everything(5)
    with pytest.raises(RuntimeError, match="inside"), kept_rng():
        _draw()
        raise RuntimeError("inside")
    assert _draw() == expected


def test_kept_rng_keeps_the_outer_state_over_an_inner_set_rng_state():
    from stabletrain.seeding import rng_state

    seed_everything(1)
    inner = rng_state()
    seed_everything(2)
    expected = _draw()
    seed_everything(2)
    with kept_rng():
        set_rng_state(inner)
        _draw()
    assert _draw() == expected


def _same_numpy_state(kept: tuple, live: tuple) -> bool:
    name, keys, pos, has_gauss, cached = kept
    return (name == live[0] and np.array_equal(keys.numpy(), live[1].astype(np.int64)) and pos == live[2]
            and has_gauss == live[3] and cached == live[4])


def test_rng_state_reads_numpy_as_get_state_does_through_every_change():
    """rng_state() reuses its last read of numpy's state while the raw key and position are unchanged (get_state costs
    ~70 us): after each kind of change it still equals np.random.get_state(), the cached Gaussian's flag included."""
    from stabletrain import seeding
    from stabletrain.seeding import rng_state

    seed_everything(11)
    steps = [lambda: None, lambda: np.random.rand(3), lambda: np.random.randn(), lambda: np.random.randn(),  # 1, then 0
             lambda: None, lambda: np.random.randint(0, 10, size=700),  # past the 624 words: the key is regenerated
             lambda: np.random.seed(11), lambda: np.random.randn(), lambda: None, lambda: np.random.seed(11)]
    flags = []
    for change in steps:
        change()
        for _ in range(2):  # a second read of the same state: the reused one where it may be
            assert _same_numpy_state(rng_state()["numpy"], np.random.get_state())
        flags.append(np.random.get_state()[3])
    assert 1 in flags and 0 in flags  # the Gaussian's cache was both set and spent
    if getattr(np.random, "get_bit_generator", None) is not None:  # numpy >= 1.25: the raw read is on, not disproved
        assert seeding._numpy_read, "the raw read of numpy's MT19937 state was switched off (its layout check failed)"
        first = rng_state()["numpy"]
        assert rng_state()["numpy"] is first  # unchanged: the last read's tuple, not a second get_state()
        np.random.rand()
        assert rng_state()["numpy"] is not first


def test_set_rng_state_back_to_a_cached_gaussian_is_read_as_set():
    """The one change the raw key misses (the Gaussian's flag, spent without a draw from the key) comes back through
    set_rng_state: the state read after it is the one set, not the last read's."""
    from stabletrain.seeding import rng_state

    seed_everything(4)
    np.random.randn()  # two Gaussians made: one cached (flag 1)
    saved = rng_state()
    assert saved["numpy"][3] == 1
    np.random.randn()  # the cached one spent: flag 0, the key unmoved
    assert rng_state()["numpy"][3] == 0
    set_rng_state(saved)
    assert _same_numpy_state(rng_state()["numpy"], np.random.get_state()) and rng_state()["numpy"][3] == 1
    assert float(np.random.randn()) == saved["numpy"][4]  # the cached Gaussian, drawn

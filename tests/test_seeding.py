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

"""The wait before a restart: none after a healthy stretch, growing while attempts die in their start-up."""

from __future__ import annotations

from stabletrain.distributed.launch import QUICK_DEATH_S, quick_deaths, restart_backoff_s


def test_the_wait_before_a_restart_is_none_at_first_and_after_a_healthy_attempt_and_doubles_over_quick_deaths():
    quick, waits = 0, []
    lives = (0.5, 120.0, 3.0, 2.0, 0.5, 1.0, 1.0, 1.0, 1.0, QUICK_DEATH_S, 0.1)
    for attempt, lived in enumerate(lives):
        quick = quick_deaths(quick, lived, restarted=attempt > 0)
        waits.append(restart_backoff_s(quick))
    assert waits == [0.0, 0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 0.0, 1.0]

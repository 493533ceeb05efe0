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


def test_a_deaths_last_line_is_the_childs_own_not_its_restart_announcement(tmp_path):
    """A child killed in its start-up printed only the line announcing its own restart: quoting it as 'its last line'
    nested every earlier restart's text into the next restart's line."""
    import os

    from stabletrain.distributed.launch import _Tee

    for output, last in ((b"step 3/10\nstabletrain: restart 2 of 3 after rank 0 (pid 1) was killed\n", ["step 3/10"]),
                         (b"stabletrain: restart 2 of 3 after rank 0 (pid 1) was killed; its last line: 'x'\n", []),
                         (b"stabletrain: restart 1 of 3 ...\nTraceback (most recent call last)\nValueError: bad\n",
                          ["ValueError: bad"])):
        read, write = os.pipe()
        sink = open(os.devnull, "wb")
        lines: list[str] = []
        tee = _Tee(os.fdopen(read, "rb"), sink.fileno(), lines)
        tee.start()
        os.write(write, output)
        os.close(write)
        tee.join(timeout=10)
        sink.close()
        assert lines == last, output

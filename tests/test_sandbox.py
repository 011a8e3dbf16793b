"""The grader's machine-wide lock on its unprivileged user: after each notebook every process of that user is
ended, so two graders on one machine (two classes, or pytest-xdist's workers) take turns running notebooks as it."""

from __future__ import annotations

import threading

import pytest

from grading import sandbox


def test_one_grader_at_a_time_runs_notebooks_as_the_user():
    user = "cs336-lock-test"  # a lock of its own: no real grading waits on this test
    entered, leave = threading.Event(), threading.Event()

    def second_grader():
        with sandbox.only_grader_as(user, threading.Event()):
            entered.set()
            leave.wait(10)

    with sandbox.only_grader_as(user, threading.Event()):
        other = threading.Thread(target=second_grader)
        other.start()
        assert not entered.wait(0.5), "a second grader ran as the user while the first did"
        interrupted = threading.Event()
        interrupted.set()  # Ctrl-C while waiting for the turn: the wait ends
        with pytest.raises(RuntimeError, match="interrupted while another grader ran a notebook as"), \
                sandbox.only_grader_as(user, interrupted):
            pass
    assert entered.wait(10), "the second grader did not get its turn once the first was done"
    leave.set()
    other.join()

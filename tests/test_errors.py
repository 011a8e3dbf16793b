"""The error a call raises, built from what the call came to (`errors.call_error`): plain data in, no processes."""

from __future__ import annotations

from cs336_parallel.errors import RESTARTED, Outcome, RankError, RankInterrupt, RankTimeout, call_error
from cs336_parallel.protocol import Failure, Frame
from cs336_parallel.text import ranks_phrase, red_headline, shorten

CELL = "/tmp/ipykernel_1234/2741263458.py"  # a notebook cell's file name (not a library's)


def raised(type_name: str, message: str, line: str = "x = 1 / 0") -> Failure:
    return Failure(type_name, f"{type_name}: {message}", [Frame(CELL, 3, "step", line)])


def waiting_in(name: str) -> list[Frame]:
    return [Frame(CELL, 7, name, "dist.barrier()")]


def test_every_rank_returned_raises_nothing_and_keeps_the_ranks():
    outcome = Outcome()
    for rank in range(3):
        outcome.add(rank, ("ok", rank * 10, True))
    assert outcome.results == {0: 0, 1: 10, 2: 20}
    assert call_error(outcome, 5.0, {}, [], {}) is None
    assert not outcome.needs_new_ranks()


def test_the_first_rank_that_raised_is_the_error_and_the_others_are_one_line_each():
    outcome = Outcome()
    outcome.add(2, ("error", raised("ValueError", "bad shape"), True))
    outcome.add(0, ("error", raised("KeyError", "'w'"), True))
    outcome.add(1, ("ok", None, True))
    error = call_error(outcome, 5.0, {}, [], {})
    assert type(error) is RankError and error.rank == 2 and error.failure is outcome.failures[2]
    assert error.headline == "rank 2 raised ValueError: bad shape"
    assert error.details == ["Traceback on rank 2 (most recent call last):", f'  File "{CELL}", line 3, in step',
                             "    x = 1 / 0", "ValueError: bad shape", "(rank 0 also raised KeyError: 'w')"]
    assert not outcome.needs_new_ranks()  # a rank that raised leaves its group usable: no restart note


def test_a_rank_that_died_comes_first_and_its_stderr_explains_a_mismatched_collective():
    outcome = Outcome()
    outcome.add(0, ("error", raised("RuntimeError", "Connection closed by peer"), True))
    outcome.add(1, ("died", "was killed by signal SIGABRT", False))
    stderr = {1: ["[rank 1 stderr] terminate called: collective mismatch",
                  "[rank 1 stderr] 40 vs 4000. Received data size doesn't match expected size"]}
    error = call_error(outcome, 5.0, {}, [], stderr)
    assert type(error) is RankError and error.rank == 1 and error.failure is None
    assert error.headline == ("rank 1 stopped at a mismatched collective: it received 40 bytes where its own call "
                              "expected 4000.")
    assert error.details == [
        "It was killed by signal SIGABRT. The ranks called collectives that do not match: another operation, or "
        "the same one with another size or dtype.", *stderr[1],
        "(rank 0 also raised RuntimeError: Connection closed by peer)", RESTARTED]
    assert outcome.needs_new_ranks()


def test_a_rank_that_died_without_a_mismatch_shows_its_last_stderr_lines():
    outcome = Outcome()
    outcome.add(3, ("died", "died (exit code 1)", False))
    error = call_error(outcome, None, {}, [], {3: ["[rank 3 stderr] Segmentation fault"]})
    assert error.headline == "rank 3 died (exit code 1)."
    assert error.details == ["[rank 3 stderr] Segmentation fault", RESTARTED]


def test_each_further_failure_is_cut_to_one_short_line():
    outcome = Outcome()
    outcome.add(0, ("error", raised("ValueError", "first"), True))
    outcome.add(1, ("error", raised("ValueError", "x" * 500), True))
    line = call_error(outcome, 5.0, {}, [], {}).details[-1]
    assert line.startswith("(rank 1 also raised ValueError: xxx") and line.endswith("...)") and len(line) == 151


def test_ranks_that_never_replied_are_a_timeout_that_says_where_each_was_waiting():
    outcome = Outcome(stuck=[0, 1])
    stacks = {0: waiting_in("wait_for_peer"), 1: []}
    error = call_error(outcome, 5.0, stacks, [1], {})
    assert type(error) is RankTimeout and error.ranks == [0, 1] and error.stacks is stacks
    assert error.headline == "ranks 0, 1 did not finish within 5 s (rank 1 is stopped)."
    assert error.details == [
        "Where each rank was waiting (most recent call last):",
        "rank 0:", f'  File "{CELL}", line 7, in wait_for_peer', "    dist.barrier()",
        "rank 1:", "  (stopped: paused by a signal such as SIGSTOP, it runs no code until continued)",
        "A collective that some ranks never call (or call in another order) waits forever; so does a loop that "
        "never ends.", RESTARTED]
    assert outcome.needs_new_ranks()


def test_a_failure_beside_ranks_still_running_names_both():
    outcome = Outcome(stuck=[1])
    outcome.add(0, ("error", raised("ValueError", "bad"), True))
    error = call_error(outcome, 5.0, {1: waiting_in("recv")}, [], {})
    assert type(error) is RankError and error.headline == "rank 0 raised ValueError: bad"
    assert error.details[-5:] == ["Still running, now stopped: rank 1. Where each was waiting:", "rank 1:",
                                  f'  File "{CELL}", line 7, in recv', "    dist.barrier()", RESTARTED]


def test_an_interrupt_says_where_each_rank_was():
    outcome = Outcome(stuck=[0, 1], interrupted=True)
    error = call_error(outcome, None, {0: waiting_in("train"), 1: []}, [], {})
    assert isinstance(error, RankInterrupt) and isinstance(error, KeyboardInterrupt)
    assert error.headline == "stopped ranks 0, 1 and restarted the cluster (per-rank variables are reset)."
    assert error.details[:4] == ["Where each rank was (most recent call last):", "rank 0:",
                                 f'  File "{CELL}", line 7, in train', "    dist.barrier()"]
    assert error.details[4:] == ["rank 1:", "  (no Python stack: the rank was not running Python code)"]
    assert error._render_traceback_()[0] == red_headline("KeyboardInterrupt", error.headline)
    assert outcome.needs_new_ranks()


def test_a_destroyed_process_group_restarts_the_ranks_without_an_error():
    outcome = Outcome()
    outcome.add(0, ("ok", 1, False))
    outcome.add(1, ("ok", 2, True))
    assert outcome.group_gone == [0] and call_error(outcome, 5.0, {}, [], {}) is None
    assert outcome.needs_new_ranks()


def test_rank_errors_render_as_a_red_headline_and_their_details():
    error = RankError(1, "rank 1 raised ValueError: bad", ["detail"])
    assert error._render_traceback_() == ["\x1b[31mRankError\x1b[0m: rank 1 raised ValueError: bad", "detail"]
    assert str(error) == "rank 1 raised ValueError: bad\ndetail"


def test_the_text_helpers():
    assert ranks_phrase([2]) == "rank 2" and ranks_phrase([0, 1, 3]) == "ranks 0, 1, 3"
    assert shorten("abcdef", 6) == "abcdef" and shorten("abcdefg", 6) == "abc..."

"""Errors raised in the kernel on behalf of ranks, shown as the rank saw them.

The rank sends its traceback as plain data (`protocol.Failure`); the kernel fills in source lines
from its own line cache (a function defined in a notebook cell is known only to the kernel) and
names notebook cells the way IPython does (`Cell In[5]`). IPython shows `_render_traceback_()`
instead of the kernel-side traceback, so the learner sees the rank's frames, not the launcher's.

`call_error` turns what a call came to (`Outcome`: each rank's result or failure, the ranks that never
replied, where they were) into the one exception the kernel raises. It is a pure function of that data:
the cluster gathers it (and replaces its ranks when `Outcome.needs_new_ranks` says so), this decides
what the learner reads.
"""

from __future__ import annotations

import linecache
import os
import re
from dataclasses import dataclass, field
from typing import Any

from .protocol import Failure, Frame
from .text import RedTraceback, ranks_phrase, shorten

RESTARTED = "The cluster restarts before the next call (per-rank variables are reset)."
OTHER_FAILURE_CHARS = 150  # each further failing rank gets one line of at most this many characters


cell_names: dict[str, str] = {}  # a notebook's cells by file name, where this process is not its kernel


def _cell_name(filename: str) -> str:
    """`Cell In[5]` for a notebook cell's file name, the file name otherwise."""
    if filename in cell_names:
        return cell_names[filename]
    try:
        ip = get_ipython()  # type: ignore[name-defined]  # noqa: F821
        count = ip.compile._filename_map.get(filename)
    except (NameError, AttributeError):
        count = None
    return f"Cell In[{count}]" if count is not None else filename


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _short_path(filename: str) -> str:
    """`torch/distributed/distributed_c10d.py` rather than the whole site-packages path."""
    return filename.split("site-packages/", 1)[-1]


def _in_library(filename: str) -> bool:
    return "site-packages" in filename or filename.startswith(_PACKAGE_DIR) or "/lib/python3" in filename


REPEATS_SHOWN = 3  # a frame repeated more often than this in a row (a recursion) is counted, as Python does


def format_frames(frames: list[Frame]) -> list[str]:
    """Traceback lines; inside a library only the frame the caller entered is shown (that is the call
    the learner made), the frames below it are counted, and so are a recursion's repeated frames."""
    # torch wraps every collective in a logging decorator; the frame the learner called is the next one.
    frames = [f for f in frames if not (f.name == "wrapper" and f.filename.endswith("c10d_logger.py"))]
    lines: list[str] = []
    hidden = 0
    for i, (f, count) in enumerate(runs := _runs(frames)):
        if _in_library(f.filename) and i > 0 and _in_library(runs[i - 1][0].filename):
            hidden += count
            continue
        if hidden:
            lines.append(f"    ... {hidden} more frame{'s' * (hidden > 1)} inside the library")
            hidden = 0
        source = f.line or linecache.getline(f.filename, f.lineno).strip()
        for _ in range(min(count, REPEATS_SHOWN)):
            lines.append(f'  File "{_short_path(_cell_name(f.filename))}", line {f.lineno}, in {f.name}')
            if source:
                lines.append(f"    {source}")
        if count > REPEATS_SHOWN:
            lines.append(f"  [Previous frame repeated {count - REPEATS_SHOWN} more times]")
    if hidden:
        lines.append(f"    ... {hidden} more frame{'s' * (hidden > 1)} inside the library")
    return lines


def _runs(frames: list[Frame]) -> list[tuple[Frame, int]]:
    """Consecutive identical frames as (frame, how many)."""
    runs: list[tuple[Frame, int]] = []
    for f in frames:
        if runs and (runs[-1][0].filename, runs[-1][0].lineno, runs[-1][0].name) == (f.filename, f.lineno, f.name):
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((f, 1))
    return runs


def format_stacks(stacks: dict[int, list[Frame]], stopped: list[int] = ()) -> list[str]:
    """Where each rank was, as traceback lines under `rank N:`."""
    lines = []
    for rank, frames in stacks.items():
        lines.append(f"rank {rank}:")
        if rank in stopped:
            lines.append("  (stopped: paused by a signal such as SIGSTOP, it runs no code until continued)")
        else:
            lines += format_frames(frames) or ["  (no Python stack: the rank was not running Python code)"]
    return lines


_MISMATCH = re.compile(r"(\d+) vs (\d+)\. Received data size doesn't match expected size")


def collective_mismatch(stderr: list[str]) -> str | None:
    """What a rank's last stderr lines say of a collective mismatch (gloo aborts the rank on one), if anything."""
    text = "\n".join(stderr)
    if "collective mismatch" not in text:
        return None
    sizes = _MISMATCH.search(text)
    received = f": it received {sizes[1]} bytes where its own call expected {sizes[2]}" if sizes else ""
    return f"stopped at a mismatched collective{received}"


def format_failure(failure: Failure, rank: int) -> list[str]:
    lines = []
    if failure.cause is not None:
        lines += format_failure(failure.cause, rank) + ["", failure.cause_text, ""]
    if failure.frames:
        lines.append(f"Traceback on rank {rank} (most recent call last):")
        lines += format_frames(failure.frames)
    lines += failure.message.splitlines()
    if failure.type_name == "NotImplementedError" and failure.frames:
        lines += unfilled_exercise_hint(failure.frames[-1].name, failure.message)
    return lines


def unfilled_exercise_hint(function: str, message: str) -> list[str]:
    """Lines naming the exercise when `raise NotImplementedError()` (the blank stub) was reached."""
    if function == "<module>" or message.strip() not in ("NotImplementedError", "NotImplementedError:", ""):
        return []
    return [f"Hint: `{function}` is an exercise still to be filled in: write your solution in place of "
            "`raise NotImplementedError()`, run that cell, then run this one again."]


_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def parse_stack_dump(text: str, thread_id: int, launcher_file: str) -> list[Frame]:
    """The frames of one thread from a `faulthandler` dump, oldest first, from the first frame
    that `launcher_file` called (the launcher's own frames say nothing to the learner)."""
    frames: list[Frame] = []
    in_thread = False
    for line in text.splitlines():
        if header := _THREAD.match(line):
            in_thread = int(header.group(1), 16) == thread_id
        elif in_thread and (frame := _FRAME.match(line)):
            frames.append(Frame(frame.group(1), int(frame.group(2)), frame.group(3)))
    frames.reverse()
    launcher = [i for i, f in enumerate(frames) if f.filename == launcher_file]
    return frames[launcher[-1] + 1:] if launcher else frames


class RankError(RedTraceback, RuntimeError):
    """A rank raised an exception or died during a cluster call."""

    def __init__(self, rank: int, headline: str, details: list[str], failure: Failure | None = None):
        self.rank = rank
        self.headline = headline
        self.details = details
        self.failure = failure  # what the rank raised, as data (None if it died or hung)
        super().__init__("\n".join([headline, *details]))


class RankTimeout(RankError):
    """Ranks did not finish a call within the timeout; `stacks` says where each one was waiting."""

    def __init__(self, ranks: list[int], headline: str, details: list[str], stacks: dict[int, list[Frame]]):
        self.ranks = ranks
        self.stacks = stacks
        super().__init__(ranks[0], headline, details)


class RankInterrupt(RedTraceback, KeyboardInterrupt):
    """The kernel was interrupted during a cluster call; shows where each rank was when it was stopped."""

    shown_name = "KeyboardInterrupt"

    def __init__(self, headline: str, details: list[str]):
        self.headline, self.details = headline, details
        super().__init__("\n".join([headline, *details]))


@dataclass
class Outcome:
    """What one call came to: each rank's result or failure, and the ranks that never replied."""

    results: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, Failure | str] = field(default_factory=dict)  # a str says how the rank died
    stuck: list[int] = field(default_factory=list)  # ranks still running when the wait ended
    interrupted: bool = False  # the kernel was interrupted while it waited
    group_gone: list[int] = field(default_factory=list)  # ranks whose process group was destroyed

    def add(self, rank: int, reply: tuple) -> None:
        """Record rank `rank`'s reply, `(kind, value, group_intact)` (see `protocol`)."""
        kind, value, group_intact = reply
        if not group_intact:
            self.group_gone.append(rank)
        if kind == "ok":
            self.results[rank] = value
        else:
            self.failures[rank] = value

    @property
    def died(self) -> dict[int, str]:
        """The ranks whose process ended during the call, with how."""
        return {rank: how for rank, how in self.failures.items() if isinstance(how, str)}

    def needs_new_ranks(self) -> bool:
        """Whether the ranks must be replaced before the next call. A rank that raised leaves its group
        usable; one that was interrupted, hung, died or destroyed the process group does not."""
        return self.interrupted or bool(self.stuck or self.died or self.group_gone)


def call_error(outcome: Outcome, timeout: float | None, stacks: dict[int, list[Frame]], stopped: list[int],
               stderr: dict[int, list[str]]) -> RankError | RankInterrupt | None:
    """The exception that `outcome` raises in the kernel; None if every rank returned a result.

    `stacks` says where each stuck rank was and `stopped` which of them were stopped (paused by a signal);
    `stderr` holds the last stderr lines of each rank that died (how a rank's own crash explains itself).
    An interrupt comes first, then the root cause of a failure (a rank that died, else the first rank that
    raised), then a timeout."""
    if outcome.interrupted:
        return RankInterrupt(f"stopped {ranks_phrase(outcome.stuck)} and restarted the cluster "
                             "(per-rank variables are reset).",
                             ["Where each rank was (most recent call last):", *format_stacks(stacks, stopped)])
    if outcome.failures:
        return _failure_error(outcome, stacks, stopped, stderr)
    if outcome.stuck:
        return _timeout_error(outcome.stuck, timeout, stacks, stopped)
    return None


def _timeout_error(ranks: list[int], timeout: float | None, stacks: dict[int, list[Frame]],
                   stopped: list[int]) -> RankTimeout:
    still = f" ({ranks_phrase(stopped)} {'is' if len(stopped) == 1 else 'are'} stopped)" if stopped else ""
    details = ["Where each rank was waiting (most recent call last):", *format_stacks(stacks, stopped),
               "A collective that some ranks never call (or call in another order) waits forever; "
               "so does a loop that never ends.", RESTARTED]
    return RankTimeout(ranks, f"{ranks_phrase(ranks)} did not finish within {timeout:g} s{still}.", details, stacks)


def _failure_error(outcome: Outcome, stacks: dict[int, list[Frame]], stopped: list[int],
                   stderr: dict[int, list[str]]) -> RankError:
    rank = next(iter(outcome.died), next(iter(outcome.failures)))
    failure = outcome.failures[rank]
    if isinstance(failure, str):
        tail = stderr.get(rank, [])
        mismatch = collective_mismatch(tail)
        headline = f"rank {rank} {mismatch or failure}."
        details = ([f"It {failure}. The ranks called collectives that do not match: another operation, or "
                    "the same one with another size or dtype."] if mismatch else []) + tail
    else:
        headline = f"rank {rank} raised {failure.headline}"
        details = format_failure(failure, rank)
    for other, f in outcome.failures.items():
        if other != rank:
            summary = f if isinstance(f, str) else f"raised {f.headline}"
            details.append(shorten(f"(rank {other} also {summary}", OTHER_FAILURE_CHARS) + ")")
    if stacks or stopped:
        details += [f"Still running, now stopped: {ranks_phrase(outcome.stuck)}. Where each was waiting:",
                    *format_stacks(stacks, stopped)]
    if outcome.needs_new_ranks():
        details.append(RESTARTED)
    return RankError(rank, headline, details, None if isinstance(failure, str) else failure)

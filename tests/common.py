"""What the tests share that is not a fixture: the repository's root, how to wait for processes and output, and
what one pytest-xdist worker runs together.

A test waits on evidence that something happened (a line printed, a file that appears, a process state in /proc),
never on a sleep that hopes it has: `wait_until` polls for it up to a generous deadline, then fails saying what it
waited for; `Lines` reads a process's output in the background, so that waiting for a line ends at the line, at
the end of the output, or at the deadline, never in a read that blocks. How long things take is for the benchmarks
(`python -m cs336_parallel.bench`), not for assertions: the suite passes on a loaded machine too.

(conftest.py holds the fixtures and hooks; this plain module is what test modules import.)
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TypeVar

from cs336_parallel import procfs

ROOT = Path(__file__).resolve().parent.parent
# How long a test waits for something that takes well under a second on a quiet machine: a deadline for a wait that
# fails, never the time a passing test takes (each wait ends as soon as its evidence is there).
PATIENCE_S = 120.0

T = TypeVar("T")


def xdist_unit(nodeid: str) -> str:
    """The tests one pytest-xdist worker runs together (tests/conftest.py): a module, so that its fixtures are built
    once, or one notebook's mutation run (`tests/test_mutations.py[03_zero_fsdp]`), so that both workers grade."""
    module, _, test = nodeid.partition("::")
    if module.endswith("test_mutations.py") and test.endswith("]"):
        return f"{module}[{test.rsplit('[', 1)[1]}"
    return module


def wait_until(condition: Callable[[], T], what: str, timeout: float = PATIENCE_S, interval: float = 0.02) -> T:
    """Poll `condition` until it returns something true, and return that; fail after `timeout` seconds saying that
    `what` did not happen."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:g} s for {what}")
        time.sleep(interval)


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    if os.path.isdir("/proc"):
        return procfs.state(pid) not in (None, "Z")
    try:  # no /proc (macOS)
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def wait_gone(pids: list[int], timeout: float = PATIENCE_S) -> list[int]:
    """Wait until none of `pids` is alive; return those still alive after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if pid_alive(p)]
        if not alive:
            return []
        time.sleep(0.02)
    return [p for p in pids if pid_alive(p)]


class Lines:
    """A process's output (a text stream, such as a Popen's stdout), read line by line in a thread of its own."""

    _END = object()

    def __init__(self, stream: IO[str], errors: IO[str] | None = None):
        self._queue: queue.Queue = queue.Queue()
        self._errors = errors  # the process's stderr: quoted when a wait fails
        self.seen = ""  # every line taken so far
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in iter(stream.readline, ""):
            self._queue.put(line)
        self._queue.put(self._END)

    def _failed(self, why: str) -> AssertionError:
        stderr = self._errors.read() if why.startswith("the output ended") and self._errors else ""
        return AssertionError(f"{why}; the output so far:\n{self.seen}" + (f"\nstderr:\n{stderr}" if stderr else ""))

    def wait_for(self, *texts: str, timeout: float = PATIENCE_S) -> str:
        """Read lines until each of `texts` has been in one of them (in any order); return what this call read.
        Fails when the output ends first, or after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        start, missing = len(self.seen), list(texts)
        while missing:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise self._failed(f"waited {timeout:g} s for lines with {missing}") from None
            if line is self._END:
                self._queue.put(self._END)
                raise self._failed(f"the output ended without lines with {missing}")
            self.seen += line
            missing = [text for text in missing if text not in line]
        return self.seen[start:]

    def rest(self, timeout: float = PATIENCE_S) -> str:
        """Everything up to the end of the output (the process closed it: it exited); fails after `timeout`."""
        deadline = time.monotonic() + timeout
        start = len(self.seen)
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise self._failed(f"waited {timeout:g} s for the output to end") from None
            if line is self._END:
                self._queue.put(self._END)
                return self.seen[start:]
            self.seen += line

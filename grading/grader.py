"""The grader's side of the trust boundary: the course's test cells run here, in the grader's own process, and
reach a submission's exercises only by requests to its sandboxed kernel.

While the executor runs a submission (grading/runner.py), each cell goes one of three ways (`TestSession.kind`):
- a test cell of the course (its source is one of the master's test cells, hidden tests included): run here by
  `TestSession.run_test`. Its requests (`%cs336_call`, cs336_parallel.boundary) ask the kernel to call the
  exercise or run a driver on the ranks, and bring back plain data, read without running code; every expected
  value and every comparison stays here. The kernel never receives the test's code, so no display, exception
  or stack of the student's can show it. The cell's outputs are what the test printed, the text the student's
  code printed during its requests, and the verdict;
- a `%%test_helpers` cell of the course: run in the kernel (its drivers must be there) and here (its checks);
- anything else: run in the kernel.
Only the master's own sources are trusted: a cell a student writes, whatever it looks like, runs in the kernel.
"""

from __future__ import annotations

import base64
import builtins
import threading
from pathlib import Path
from typing import Any, Protocol

import nbformat
from nbformat.notebooknode import NotebookNode

from cs336_parallel import testcell
from cs336_parallel.boundary import RESULT_MIME, Boundary, RemoteError, decode, encode, to_wire, unpack
from cs336_parallel.checks import hang_timeout_s
from cs336_parallel.text import red_headline

MAX_STUDENT_OUTPUT = 10_000  # characters of what the student's code prints during one test, kept in its output
REQUEST_MARGIN_S = 60.0  # a request may take its own timeout plus this (ranks restart, results travel)
# Submissions are graded in threads of one process, and test code uses process-wide state (torch's default random
# generator seeds the reference models). So the course's test code runs one thread at a time, and lets go of
# this lock only while it waits for a kernel: the waiting, where the time goes, still happens in parallel.
TEST_CODE = threading.Lock()


class Kernel(Protocol):
    """What the tests need of the executor running the submission (grading/runner.py's LimitedExecute)."""

    def run_request(self, code: str, timeout: float) -> list[NotebookNode]:
        """Run `code` in the kernel outside the notebook; its outputs."""

    def loopback_bytes(self) -> int | None:
        """Bytes sent so far on the sandbox's loopback interface (None without a sandbox)."""


def test_header(source: str) -> list[str] | None:
    """The exercise names of a `%%test NAME ...` cell, None for any other cell."""
    head = source.split("\n", 1)[0].split()
    return head[1:] if head[:1] == ["%%test"] and len(head) > 1 else None


class TestSession:
    """One submission's tests, on the grader's side: the master's test and helper cells, and their namespace."""

    __test__ = False  # not a pytest test class

    def __init__(self, master: Path, executor: Kernel):
        nb = nbformat.read(master, as_version=4)
        self.tests = {c.source for c in nb.cells if c.cell_type == "code" and test_header(c.source)}
        self.helper_cells = {c.source for c in nb.cells if c.source.startswith("%%test_helpers")}
        self.helpers: dict[str, Any] = {}
        self.boundary = KernelBoundary(executor, self)
        self.builtins = {**vars(builtins), "print": self._print}
        self.shown: list[str] = []  # the current test's output, in order
        self.student_chars = 0

    def kind(self, cell: NotebookNode) -> str | None:
        if cell.cell_type != "code":
            return None
        if cell.source in self.tests:
            return "test"
        if cell.source in self.helper_cells:
            return "helpers"
        return None

    def define_helpers(self, cell: NotebookNode, index: int) -> None:
        body = cell.source.split("\n", 1)[1] if "\n" in cell.source else ""
        with TEST_CODE:
            testcell.define_helpers("\n" + body, self.helpers, filename=f"<test helpers, cell {index}>",
                                    builtin_names=self.builtins)

    def run_test(self, cell: NotebookNode) -> list[NotebookNode]:
        """Run a course test cell here; its outputs (never stderr: a student's warning costs no points)."""
        names = test_header(cell.source)
        body = cell.source.split("\n", 1)[1] if "\n" in cell.source else ""
        self.shown, self.student_chars = [], 0
        failure = None
        try:
            with TEST_CODE:
                testcell.run_test("\n" + body, names, boundary=self.boundary, helpers=self.helpers,
                                  filename=f"<test of {' '.join(names)}>", builtin_names=self.builtins)
        except testcell.TestFailed as e:
            failure = e
        except Exception as e:  # noqa: BLE001 - whatever a reply held, this test fails and the notebook goes on
            failure = testcell.TestFailed(f"the test could not run on what the notebook replied: "
                                          f"{type(e).__name__}: {e}"[:400])
        outputs = [nbformat.v4.new_output("stream", name="stdout", text="".join(self.shown))] if self.shown else []
        if failure is not None:
            outputs.append(test_failed(failure.reason, failure.frames))
        return outputs

    def _print(self, *values, sep: str | None = " ", end: str | None = "\n", file=None, flush: bool = False) -> None:
        self.shown.append((" " if sep is None else sep).join(map(str, values)) + ("\n" if end is None else end))

    def student_printed(self, text: str) -> None:
        """What the student's code printed during a request, kept as plain text, up to MAX_STUDENT_OUTPUT."""
        room = MAX_STUDENT_OUTPUT - self.student_chars
        if room > 0:
            self.shown.append(text[:room] if len(text) <= room else text[:room] + "\n[... more output cut]\n")
        self.student_chars += len(text)

    def helper_ids(self) -> dict[int, str]:
        """The functions and classes of the helper cells, by id: they cross to the kernel by name."""
        return {id(v): k for k, v in self.helpers.items() if callable(v)}


def test_failed(reason: str, frames: list[str] = ()) -> NotebookNode:
    return nbformat.v4.new_output("error", ename="TestFailed", evalue=reason,
                                  traceback=[red_headline("TestFailed", reason), *frames])


class KernelStopped(RemoteError):
    """The kernel stopped answering during a request (a limit, or it died): the notebook stops here."""

    def __init__(self, reason: str):
        super().__init__({"type": "KernelStopped", "message": reason, "headline": reason})


class KernelBoundary(Boundary):
    """Requests from the grader's test cells to the submission's kernel, as `%cs336_call` cells run by the executor
    outside the notebook (nothing of them is saved); replies are read with `boundary.decode`."""

    def __init__(self, executor: Kernel, session: TestSession):
        self.executor, self.session = executor, session

    def begin(self, names):
        return self._request({"kind": "begin", "names": list(names)}, hang_timeout_s())

    def call(self, fn, args, kwargs):
        return self._request({"kind": "call", "fn": fn, "args": tuple(args), "kwargs": dict(kwargs)}, hang_timeout_s())

    def call_each(self, fn, cases):
        return self._request({"kind": "call_each", "fn": fn, "cases": [tuple(c) for c in cases]}, hang_timeout_s())

    def run(self, world_size, fn, args, kwargs, timeout):
        self._request({"kind": "ready", "world_size": world_size}, timeout)  # joined: no set-up in the measurement
        before = self.executor.loopback_bytes()
        try:
            return self._request({"kind": "run", "world_size": world_size, "fn": fn, "args": tuple(args),
                                  "kwargs": dict(kwargs), "timeout": timeout}, timeout)
        finally:
            after = self.executor.loopback_bytes()
            self.traffic = None if before is None or after is None else after - before

    def _request(self, request: dict, timeout: float) -> Any:
        payload = base64.b64encode(encode(to_wire(request, self.session.helper_ids()))).decode("ascii")
        TEST_CODE.release()  # held by the test code that asks; others may run while this one waits
        try:
            outputs = self.executor.run_request(f"%cs336_call {payload}", timeout + REQUEST_MARGIN_S)
        finally:
            TEST_CODE.acquire()
        replies = []
        for output in outputs:
            if output.output_type == "stream":
                self.session.student_printed(output.text)
            elif output.output_type in ("display_data", "execute_result") and RESULT_MIME in output.get("data", {}):
                replies.append(output.data[RESULT_MIME])
            elif output.output_type == "error":
                return unpack({"error": {"type": output.ename, "message": output.evalue,
                                         "headline": f"the kernel could not answer: {output.ename}: {output.evalue}"}})
        if len(replies) != 1:
            return unpack({"error": {"type": "NoReply", "message": f"{len(replies)} replies to one request",
                                     "headline": "the kernel did not answer the test's request (the notebook's "
                                                 "code changed how the kernel runs cells?)"}})
        try:
            reply = decode(base64.b64decode(replies[0]))
        except Exception as e:  # noqa: BLE001 - whatever the reply holds, it is refused, not run
            return unpack({"error": {"type": "NotPlainError", "message": str(e),
                                     "headline": f"the reply could not be read as plain data: {e}"}})
        if not isinstance(reply, dict) or not ({"ok"} == set(reply) or {"error"} == set(reply)):
            return unpack({"error": {"type": "NotPlainError", "message": "not a reply",
                                     "headline": "the kernel's reply is not one the test asked for"}})
        return unpack(reply)

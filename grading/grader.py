"""The grader's side of the trust boundary: the course's test cells run here, in the grader's own process, and
reach a submission's exercises only by requests.

While the executor runs a submission (grading/runner.py), a cell whose source is one of the master's test cells
(hidden tests included; `selfcheck.test_names`) runs here (`TestSession.run_test`); any other cell, whatever it
looks like, runs in the kernel. A test's requests go two ways (`KernelBoundary`):
- `begin`, `call`, `call_each`: to the sandboxed kernel, as `%cs336_call` (its reply is a file the grader reads,
  within what is left of the notebook's output limit);
- `run`: to the grader's own test ranks (grading/rank_box.py), which the kernel cannot reach; the kernel only
  hands over its exercises, pickled, and each rank gets its own share of the data the test drew.
Replies are plain data (`cs336_parallel.plain`), read without running code and outside `TEST_CODE`. The kernel
never receives a test's code, so no display, exception or stack of the student's can show it.
"""

from __future__ import annotations

import base64
import builtins
import os
import threading
from pathlib import Path
from typing import Any, Protocol

import nbformat
from nbformat.notebooknode import NotebookNode

from cs336_parallel import plain, testcell
from cs336_parallel.boundary import Boundary, RemoteError, exercises_named, failure, rank_requests, to_wire, unpack
from cs336_parallel.checks import hang_timeout_s
from cs336_parallel.selfcheck import test_names
from cs336_parallel.text import printable, red_headline
from grading.rank_box import BoxStopped, RankBox, ReplyTooLarge

MAX_STUDENT_OUTPUT = 10_000  # characters of what the student's code prints during one test, kept in its output
REQUEST_MARGIN_S = 60.0  # a request may take its own timeout plus this (ranks restart, results travel)
# Submissions are graded in threads of one process, and test code uses process-wide state (torch's default random
# generator, its thread pool). So the course's test code runs one thread at a time, and lets go of this lock while
# it waits for a kernel or its test ranks, and while it reads their replies: that is where the time goes.
TEST_CODE = threading.Lock()


class Kernel(Protocol):
    """What the tests need of the executor running the submission (grading/runner.py's LimitedExecute)."""

    ranks: RankBox  # the grader's test ranks for this notebook
    reply_path: Path  # where the kernel writes its reply to a request

    def run_request(self, code: str, timeout: float) -> list[NotebookNode]:
        """Run `code` in the kernel outside the notebook; its outputs."""

    def allowance(self) -> int:
        """Bytes a reply may still take: what is left of the notebook's output limit."""

    def charge(self, nbytes: int) -> None:
        """Count a reply against the output limit."""

    def stop(self, reason: str) -> None:
        """No further cell runs: the notebook stops here, with `reason`."""


class TestSession:
    """One submission's tests, on the grader's side: the master's test cells, and what they print."""

    __test__ = False  # not a pytest test class

    def __init__(self, master: Path, executor: Kernel):
        nb = nbformat.read(master, as_version=4)
        self.tests = {c.source for c in nb.cells if test_names(c)}
        self.boundary = KernelBoundary(executor, self)
        self.builtins = {**vars(builtins), "print": self._print}
        self.printed: list[str] = []  # the current test's output, in order
        self.student_chars = 0

    def is_test(self, cell: NotebookNode) -> bool:
        return cell.cell_type == "code" and cell.source in self.tests

    def run_test(self, cell: NotebookNode) -> list[NotebookNode]:
        """Run a course test cell here; its outputs (never stderr: a student's warning costs no points)."""
        names = test_names(cell)
        body = cell.source.split("\n", 1)[1] if "\n" in cell.source else ""
        self.printed, self.student_chars = [], 0
        self.boundary.exported = {}
        failed = None
        try:
            with TEST_CODE:
                testcell.run_test("\n" + body, names, boundary=self.boundary, filename=f"<test of {' '.join(names)}>",
                                  builtin_names=self.builtins)
        except testcell.TestFailed as e:
            failed = e
        except Exception as e:  # noqa: BLE001 - whatever a reply held, this test fails and the notebook goes on
            failed = testcell.TestFailed(f"the test could not run on what the notebook replied: "
                                         f"{type(e).__name__}: {e}"[:400])
        outputs = [nbformat.v4.new_output("stream", name="stdout", text="".join(self.printed))] if self.printed else []
        if failed is not None:
            outputs.append(test_failed(printable(failed.reason), [printable(f) for f in failed.frames]))
        return outputs

    def _print(self, *values, sep: str | None = " ", end: str | None = "\n", file=None, flush: bool = False) -> None:
        self.printed.append((" " if sep is None else sep).join(map(str, values)) + ("\n" if end is None else end))

    def student_printed(self, text: str) -> None:
        """What the student's code printed during a request, kept as printable text, up to MAX_STUDENT_OUTPUT."""
        room = MAX_STUDENT_OUTPUT - self.student_chars
        if room > 0 and text:
            text = printable(text, keep_newlines=True)
            self.printed.append(text[:room] if len(text) <= room else text[:room] + "\n[... more output cut]\n")
        self.student_chars += len(text)


def test_failed(reason: str, frames: list[str] = ()) -> NotebookNode:
    return nbformat.v4.new_output("error", ename="TestFailed", evalue=reason,
                                  traceback=[red_headline("TestFailed", reason), *frames])


class KernelStopped(RemoteError):
    """The kernel stopped answering during a request (a limit, or it died): the notebook stops here."""

    def __init__(self, reason: str):
        super().__init__({"type": "KernelStopped", "message": reason, "headline": reason})


class KernelBoundary(Boundary):
    """A test's requests, from the grader: to the submission's kernel (`%cs336_call` cells the executor runs outside
    the notebook, nothing of them saved) and to the grader's test ranks."""

    def __init__(self, executor: Kernel, session: TestSession):
        self.executor, self.session = executor, session
        self.exported: dict[tuple, dict] = {}  # the exercises the current test cell's ranks run, from the kernel
        self.tested: tuple = ()

    def begin(self, names):
        found = self._kernel({"kind": "begin", "names": list(names)}, hang_timeout_s())
        # Fresh ranks for the tests of another exercise, or of another definition of it (the kernel's word: a
        # submission that lies here only shares its own ranks between its own answers).
        tested = tuple((n, found.get(n, {}).get("version") if isinstance(found, dict) and isinstance(
            found.get(n), dict) else None) for n in names)
        if tested != self.tested:
            self.tested = tested
            self._ranks(lambda: self.executor.ranks.fresh(tested, hang_timeout_s() + REQUEST_MARGIN_S))
        return found

    def call(self, fn, args, kwargs):
        return self._kernel({"kind": "call", "fn": fn, "args": tuple(args), "kwargs": dict(kwargs)}, hang_timeout_s())

    def call_each(self, fn, cases):
        return self._kernel({"kind": "call_each", "fn": fn, "cases": [tuple(c) for c in cases]}, hang_timeout_s())

    def run(self, world_size, fn, args, kwargs, per_rank, timeout, fresh=False):
        self.traffic = self.memory = None
        wired = rank_requests(fn, args, kwargs, per_rank)
        exported = self._export(sorted(exercises_named(wired)))
        requests = [plain.encode(r) for r in wired]
        if fresh:
            self._ranks(lambda: self.executor.ranks.restart(hang_timeout_s() + REQUEST_MARGIN_S))
        reply, self.traffic, self.memory = self._ranks(lambda: self.executor.ranks.run(
            world_size, exported["exercises"], exported["cells"], requests, timeout, self.executor.allowance()))
        if isinstance(reply, dict) and isinstance(reply.get("printed"), str):
            self.session.student_printed(reply.pop("printed"))
        replies = unpack(reply)
        if not (isinstance(replies, list) and all(isinstance(r, bytes) for r in replies)):
            raise failure("NotPlainError", "the test ranks' reply is not one the test asked for")
        self.executor.charge(sum(map(len, replies)))
        try:
            return [plain.decode(r) for r in replies]
        except plain.NotPlainError as e:
            raise failure("NotPlainError", f"a rank's result could not be read as plain data: {e}") from None

    def _export(self, names: list[str]) -> dict:
        """The exercises `names`, pickled by the kernel (once per test cell), with the cells that define them."""
        if not names:
            return {"exercises": b"", "cells": {}}
        if tuple(names) not in self.exported:
            export = self._kernel({"kind": "export", "names": names}, hang_timeout_s())
            if not (isinstance(export, dict) and isinstance(export.get("exercises"), bytes)
                    and isinstance(export.get("cells"), dict)):
                raise failure("NotPlainError", "the kernel's exercises could not be read")
            self.exported[tuple(names)] = export
        return self.exported[tuple(names)]

    # -- the two ways a request goes, each waiting without TEST_CODE -------------------------------------------
    def _ranks(self, request) -> Any:
        TEST_CODE.release()
        try:
            return request()
        except ReplyTooLarge as e:
            self.executor.stop(str(e))
            raise KernelStopped(str(e)) from None
        except BoxStopped as e:
            raise failure("TestRanksStopped", str(e)) from None
        finally:
            TEST_CODE.acquire()

    def _kernel(self, request: dict, timeout: float) -> Any:
        payload = base64.b64encode(plain.encode(to_wire(request))).decode("ascii")
        path = self.executor.reply_path
        TEST_CODE.release()  # held by the test code that asks; others may run while this one waits
        try:
            path.unlink(missing_ok=True)
            outputs = self.executor.run_request(f"%cs336_call {path} {payload}", timeout + REQUEST_MARGIN_S)
            reply = self._read_reply(path, outputs)
        finally:
            TEST_CODE.acquire()
        return unpack(reply)

    def _read_reply(self, path: Path, outputs: list[NotebookNode]) -> Any:
        for output in outputs:
            if output.output_type == "stream":
                self.session.student_printed(output.text)
            elif output.output_type == "error":
                return {"error": {"type": output.ename, "message": output.evalue,
                                  "headline": f"the kernel could not answer: {output.ename}: {output.evalue}"}}
        try:
            size = os.stat(path).st_size
        except OSError:
            return {"error": {"type": "NoReply", "message": "no reply",
                              "headline": "the kernel did not answer the test's request (the notebook's code changed "
                                          "how the kernel runs cells?)"}}
        allowed = self.executor.allowance()
        if size > allowed:
            reason = (f"a reply of {size / 2**20:.1f} MB from the kernel passed what is left of the notebook's "
                      f"output limit ({allowed / 2**20:.1f} MB)")
            self.executor.stop(reason)
            raise KernelStopped(reason)
        self.executor.charge(size)
        with open(path, "rb") as f:
            data = f.read(allowed + 1)
        try:
            return plain.decode(data, max_bytes=allowed)
        except plain.NotPlainError as e:
            return {"error": {"type": "NotPlainError", "message": str(e),
                              "headline": f"the reply could not be read as plain data: {e}"}}

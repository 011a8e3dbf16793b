"""`%%test NAME`: a test cell, and how it runs on either side of the trust boundary.

    %%test ring_all_reduce
    got = checks.run(4, run_all_reduce, ring_all_reduce, 1000)
    expected = sum(checks.random_tensor((1000,), seed=r) for r in range(4))
    for rank, result in enumerate(got):
        checks.assert_close(result["x"], expected, name="x", rank=rank)

A test cell's code is the test's own. It reaches the exercise `NAME` only through a handle (`boundary.Exercise`):
calling it, or running a driver on the ranks with it (`checks.run`), is a request that returns plain data, which
the test compares with values it computes itself. It runs in a namespace of its own: the builtins, `torch`,
`dist`, `nn`, `F`, `math`, `checks`, what the `%%test_helpers` cells defined, and a handle (or the plain value) of
each exercise it names. Nothing else of the notebook's reaches it. It fails with one line that says which case
failed, then the frames of the learner's own code; the test's code is never shown.

Where it runs:
- in the notebook, the learner's loop: in the kernel, through `InProcess` (the student version's visible tests);
- when a notebook is graded: in the grader's process (grading/grader.py), which holds the hidden tests and sends
  each request to the sandboxed kernel. A kernel asked to run a `%%test` cell while it is being graded refuses:
  the grader's configuration did not load, and no test is trusted there.
"""

from __future__ import annotations

import builtins
import math
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import checks
from .boundary import Boundary, Exercise, InProcess, KernelSide, RemoteError
from .text import RedTraceback, shorten

MAX_REASON = 400  # characters of the one-line reason


class TestFailed(RedTraceback, AssertionError):
    """A test cell's verdict: `reason` is the one line a learner (and nbgrader's feedback) sees, `frames` the
    learner's own frames shown under it."""

    __test__ = False  # not a pytest test class
    shown_name = "TestFailed"

    def __init__(self, reason: str, frames: list[str] | None = None):
        self.reason, self.frames = reason, frames or []
        super().__init__(reason)

    @property
    def headline(self) -> str:
        return self.reason

    @property
    def details(self) -> list[str]:
        return self.frames


def base_namespace(builtin_names: dict | None = None) -> dict:
    """What every test and helper cell starts with."""
    return {"__builtins__": builtin_names or vars(builtins), "__name__": "__test__",
            "torch": torch, "dist": dist, "nn": nn, "F": F, "math": math, "checks": checks}


def define_helpers(source: str, helpers: dict, *, filename: str, builtin_names: dict | None = None) -> None:
    """Run a read-only `%%test_helpers` cell: what it defines joins `helpers`, which every later test cell sees
    (and nothing else: its drivers run on the ranks, its checks in the test)."""
    namespace = base_namespace(builtin_names) | helpers
    exec(compile(source, filename, "exec"), namespace)
    helpers.update({k: v for k, v in namespace.items() if not k.startswith("__")})


def run_test(source: str, names: Sequence[str], *, boundary: Boundary, helpers: dict, filename: str,
             builtin_names: dict | None = None) -> None:
    """Run a test cell's `source` for the exercises `names` across `boundary`; raise `TestFailed` if it fails."""
    try:
        found = boundary.begin(names)
        kinds = {n: found[n]["kind"] for n in names}
    except RemoteError as e:
        raise TestFailed(_one_line(f"the notebook could not be asked for {_listed(names)}: {e.headline}")) from None
    except (TypeError, KeyError, IndexError):
        raise TestFailed(f"the notebook's kernel did not say what {_listed(names)} is: no test runs") from None
    missing = [n for n in names if kinds[n] == "missing"]
    if missing:
        raise TestFailed(f"{_listed(missing)} is not defined: run the cell that defines it, then this one.")
    handles = {n: found[n].get("value") if kinds[n] == "value" else Exercise(n, boundary, kinds[n]) for n in names}
    namespace = base_namespace(builtin_names) | helpers | handles
    try:
        with checks.using(boundary):
            exec(compile(source, filename, "exec"), namespace)
    except KeyboardInterrupt:
        raise
    except TestFailed:
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure becomes the test's verdict
        raise TestFailed(*explain(exc, names)) from None


def explain(exc: BaseException, names: Sequence[str]) -> tuple[str, list[str]]:
    """The one-line reason for `exc`, and the learner's own frames (lines of notebook cells) under it."""
    case = f"{exc.case}: " if getattr(exc, "case", "") else ""
    if isinstance(exc, RemoteError):
        if exc.unfilled:
            return f"{_listed(names)} is not implemented yet (its cell still raises NotImplementedError).", []
        headline = exc.headline
        if exc.type_name == "AssertionError" and exc.rank is not None:  # a driver's own check: its message says why
            message = exc.message or "an assertion failed"
            headline = message if message.startswith("rank ") else f"rank {exc.rank}: {message}"
        return _one_line(case + headline), exc.frames
    message = str(exc) or "(no message)"
    reason = message if isinstance(exc, AssertionError) else f"{type(exc).__name__}: {message}"
    return _one_line(case + reason), []


def _one_line(text: str) -> str:
    return shorten(re.sub(r"\s*\n\s*", " / ", text.strip()), MAX_REASON)


def _listed(items: Sequence[str]) -> str:
    items = list(items)
    return ", ".join(f"`{i}`" if re.fullmatch(r"\w+", i) else i for i in items[:3]) + (
        " and more" if len(items) > 3 else "")


# -- the kernel's side: the learner's loop, and the grader's requests ------------------------------------------------

helpers: dict[str, Any] = {}  # what this kernel's `%%test_helpers` cells defined (drivers, data, checks)


def kernel_side(user_ns: dict, is_cell: Callable[[str], bool]) -> KernelSide:
    """This kernel's side of the boundary: the notebook's names are the exercises, its helper cells the drivers."""
    return KernelSide(user_ns, helpers, is_cell)


def run_in_notebook(source: str, names: Sequence[str], user_ns: dict, *, filename: str,
                    is_cell: Callable[[str], bool]) -> None:
    """A `%%test` cell in the learner's own kernel: the test runs here, through `InProcess`. Refused while the
    notebook is being graded (nbgrader's executor sets NBGRADER_EXECUTION): then tests run in the grader."""
    if os.environ.get("NBGRADER_EXECUTION") == "autograde":
        raise TestFailed("this test cell reached the notebook's kernel while it was graded: tests run in the "
                         "grader's own process, so the course's grading configuration did not load; no test runs "
                         "here.")
    run_test(source, names, boundary=InProcess(kernel_side(user_ns, is_cell)), helpers=helpers, filename=filename)

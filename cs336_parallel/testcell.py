"""`%%test NAME`: a test cell, and how it runs on either side of the trust boundary.

    %%test ring_all_reduce
    from cs336_parallel.testing.collectives import check_all_reduce
    check_all_reduce(ring_all_reduce, 4, (1000,), torch.float32)

A test cell's code is the test's own. It reaches the exercise `NAME` only through a handle (`boundary.Exercise`):
calling it, or running a driver of the package on the ranks with it (`checks.run`), is a request that returns plain
data, which the test compares with values it computes itself from data it drew. It runs in a namespace of its own:
the builtins, `torch`, `dist`, `nn`, `F`, `math`, `checks`, what it imports (the package's test code,
`cs336_parallel.testing`), and a handle (or the plain value) of each exercise it names. Nothing of the notebook's
reaches it. Each `assert` it runs and each comparison of `checks` counts: a test that compared nothing fails. It
fails with one line that says which case failed, then the frames of the learner's own code; the test's code is
never shown.

Where it runs:
- in the notebook, the learner's loop: in the kernel, through `kernel_side.InProcess` (the visible tests);
- when a notebook is graded: in the grader's process (grading/grader.py), which holds the hidden tests. A kernel
  asked to run a `%%test` cell while it is being graded refuses: the grader's configuration did not load, and no
  test is trusted there.
"""

from __future__ import annotations

import ast
import builtins
import math
import os
import re
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import checks
from .boundary import Boundary, Exercise, RemoteError
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


def run_test(source: str, names: Sequence[str], *, boundary: Boundary, filename: str,
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
    namespace = base_namespace(builtin_names) | handles | {"__count_comparison__": checks.count_comparison}
    try:
        with checks.using(boundary):
            exec(compile(counting_asserts(source, filename), filename, "exec"), namespace)
            if not checks.compared():
                raise TestFailed("the test compared nothing: no result came back to compare")
    except KeyboardInterrupt:
        raise
    except TestFailed:
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure becomes the test's verdict
        raise TestFailed(*explain(exc, names)) from None


class _CountAsserts(ast.NodeTransformer):
    """`assert test, message` -> `__count_comparison__()` then the assert: every assert a test runs counts."""

    def visit_Assert(self, node: ast.Assert) -> list[ast.stmt]:
        count = ast.Expr(ast.Call(ast.Name("__count_comparison__", ast.Load()), [], []))
        return [ast.copy_location(count, node), node]


def counting_asserts(source: str, filename: str) -> ast.Module:
    """A test cell's code, parsed, with each `assert` counted as a comparison."""
    return ast.fix_missing_locations(_CountAsserts().visit(ast.parse(source, filename)))


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


# -- the learner's loop ---------------------------------------------------------------------------------------------

def run_in_notebook(source: str, names: Sequence[str], user_ns: dict, *, filename: str,
                    is_cell: Callable[[str], bool], cell_name: Callable[[str], str] = str) -> None:
    """A `%%test` cell in the learner's own kernel: the test runs here, through `InProcess`. Refused while the
    notebook is being graded (nbgrader's executor sets NBGRADER_EXECUTION): then tests run in the grader."""
    if os.environ.get("NBGRADER_EXECUTION") == "autograde":
        raise TestFailed("this test cell reached the notebook's kernel while it was graded: tests run in the "
                         "grader's own process, so the course's grading configuration did not load; no test runs "
                         "here.")
    from .kernel_side import InProcess, KernelSide  # the kernel's side: its test ranks (not the grader's business)

    side = KernelSide(user_ns, is_cell, cell_name)
    run_test(source, names, boundary=InProcess(side), filename=filename)

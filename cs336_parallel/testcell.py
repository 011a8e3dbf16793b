"""`%%test NAME`: how a notebook's test cell runs, so that its verdict can be trusted and understood.

    %%test ring_all_reduce
    checks.run(4, check_all_reduce, ring_all_reduce)

Answer cells run in the same kernel, and on the same ranks, as the tests that grade them. So a test cell:

- runs in a namespace of its own: the builtins as they were before any answer cell ran; `torch`, `dist`,
  `nn`, `F`, `math` and `checks`; the helpers of read-only `%%test_helpers` cells; and the exercise
  `NAME`, taken from the notebook. Nothing else of the notebook's reaches it: an answer cell that defines
  `simulate` or `len` changes nothing here, and a test cannot depend on another exercise's answer.
  Anything else it needs, it imports from the package.
- gets plain values back from the exercise (`checks.plain`): a result whose `__eq__` is always true is
  refused, not compared;
- refuses to run if anything tests rely on has been replaced since the notebook loaded the extension,
  and fails if the exercise replaces something while it runs (`integrity`);
- runs its ranks fresh (`checks.fresh_ranks`): nothing an earlier cell ran on a test rank is left there;
- fails with one line that says which case failed, then the frames of the learner's own code. The
  test's own code is never shown: its hidden part is the grader's secret.
"""

from __future__ import annotations

import functools
import inspect
import math
import re
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import checks, integrity
from .errors import RankError, RankTimeout, format_frames
from .protocol import Failure, Frame
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


_helpers: dict[str, Any] = {}  # what `%%test_helpers` cells defined, out of the notebook's reach


def _base_namespace() -> dict:
    return {"__builtins__": integrity.pristine_builtins(), "__name__": "__test__",
            "torch": torch, "dist": dist, "nn": nn, "F": F, "math": math, "checks": checks}


def define_helpers(source: str, *, filename: str) -> None:
    """Run a read-only `%%test_helpers` cell: what it defines is given to every later `%%test` cell (and
    nowhere else), so the tests of one exercise can share their checks without trusting the notebook."""
    namespace = _base_namespace() | _helpers
    exec(compile(source, filename, "exec"), namespace)
    _helpers.update({k: v for k, v in namespace.items() if not k.startswith("__")})


def run_test(source: str, names: list[str], user_ns: dict, *, filename: str, is_cell: Any = None) -> None:
    """Run a test cell's `source` for the exercises `names` (see the module docstring); raise `TestFailed`."""
    tampered = integrity.changes()
    if tampered:
        raise TestFailed(f"an answer cell replaced {_listed(tampered)}, which tests rely on: no test runs in "
                         "a kernel changed this way (restart the kernel and remove that code).")
    missing = [n for n in names if n not in user_ns]
    if missing:
        raise TestFailed(f"{_listed(missing)} is not defined: run the cell that defines it, then this one.")
    checks.fresh_ranks(tuple((n, id(user_ns[n])) for n in names))
    namespace = _base_namespace() | _helpers | {n: _returning_plain(user_ns[n]) for n in names}
    try:
        exec(compile(source, filename, "exec"), namespace)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure becomes the test's verdict
        _refuse_if_tampered(names)
        raise exc if isinstance(exc, TestFailed) else TestFailed(*_explain(exc, names, is_cell)) from None
    _refuse_if_tampered(names)


def _refuse_if_tampered(names: list[str]) -> None:
    tampered = integrity.changes()
    if tampered:
        raise TestFailed(f"{_listed(names)} replaced {_listed(tampered)} while the test ran, which tests rely "
                         "on: this test scores 0 (restart the kernel and remove that code).")


def _returning_plain(obj: Any) -> Any:
    """A function that returns `plain` values; classes and other objects as they are."""
    if inspect.isclass(obj) or not callable(obj):
        return obj

    @functools.wraps(obj)
    def exercise(*args, **kwargs):
        return checks.plain(obj(*args, **kwargs), name=f"the value {getattr(obj, '__name__', 'it')} returned")

    return exercise


def _explain(exc: BaseException, names: list[str], is_cell) -> tuple[str, list[str]]:
    """The one-line reason for `exc`, and the learner's own frames (those in notebook cells) under it."""
    is_cell = is_cell or (lambda filename: False)
    case = f"{exc.case}: " if getattr(exc, "case", None) else ""
    if isinstance(exc, RankTimeout):
        frames = []
        for rank, stack in exc.stacks.items():
            frames += _frames(f"Your code on rank {rank}, where it was waiting", stack, is_cell)
        return _one_line(case + exc.headline), frames
    if isinstance(exc, RankError):
        failure = exc.failure
        if failure is not None and failure.type_name == "NotImplementedError" and not _message(failure):
            return f"{_listed(names)} is not implemented yet (its cell still raises NotImplementedError).", []
        headline = exc.headline
        if failure is not None and failure.type_name == "AssertionError":  # a check failed: its message says why
            message = _message(failure) or "an assertion failed"
            headline = message if message.startswith("rank ") else f"rank {exc.rank}: {message}"
        stack = failure.frames if failure is not None else []
        return _one_line(case + headline), _frames(f"Your code on rank {exc.rank}", stack, is_cell)
    frames = [Frame(f.filename, f.lineno or 0, f.name, f.line or "") for f in traceback.extract_tb(exc.__traceback__)]
    if isinstance(exc, NotImplementedError) and not str(exc):
        return f"{_listed(names)} is not implemented yet (its cell still raises NotImplementedError).", []
    message = str(exc) or "(no message)"
    reason = message if isinstance(exc, AssertionError) else f"{type(exc).__name__}: {message}"
    return _one_line(reason), _frames("Your code", frames, is_cell)


def _message(failure: Failure) -> str:
    return failure.message.split(":", 1)[1].strip() if ":" in failure.message else ""


def _frames(title: str, frames: list[Frame], is_cell) -> list[str]:
    mine = [f for f in frames if is_cell(f.filename)]
    return [f"{title} (most recent call last):", *format_frames(mine)] if mine else []


def _one_line(text: str) -> str:
    return shorten(re.sub(r"\s*\n\s*", " / ", text.strip()), MAX_REASON)


def _listed(items: list[str]) -> str:
    return ", ".join(f"`{i}`" if re.fullmatch(r"\w+", i) else i for i in items[:3]) + (" and more" if len(items) > 3
                                                                                        else "")

"""The trust boundary: how a test reaches an exercise, and what may come back.

A test cell (`%%test NAME`) never holds the exercise itself. It holds an `Exercise` handle, and every use of the
exercise is a request across a `Boundary`:

- `begin(names)`: what each exercise is (a function, a class, a value and which); the test ranks start fresh;
- `call(fn, args, kwargs)`: call it (or a driver that calls it) in the notebook's kernel;
- `call_each(fn, cases)`: many calls in one request;
- `run(world_size, fn, args, kwargs, per_rank, timeout, fresh)`: a driver on every rank of a test cluster
  (`checks.run`), rank r given `args + per_rank[r]`: only what that rank would hold in a real job. Afterwards
  `traffic` holds who sent how many bytes to whom, measured outside the ranks' processes (`wire`), or None.

Arguments are plain data (`plain`) or references by name: the exercise, a function or class of an importable
module (the package's drivers, torch), or a `functools.partial` of these; never code. What comes back is plain
data; a failure comes back as data too (`RemoteError`): the exception's type names, its message, the rank, and
the lines of the learner's own cells in its traceback.

Two boundaries implement the same requests:
- `kernel_side.InProcess`: the learner's own `%%test` cell, in the notebook's kernel (the visible tests);
- the grader's (grading/grader.py): the tests run in the grader's process; `begin` and `call` reach the
  sandboxed kernel (`kernel_side.KernelSide`), and `run` the grader's own test ranks (`rank_host`), which get
  the exercise from the kernel, and each rank only its own data from the grader.
"""

from __future__ import annotations

import functools
import importlib
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from .errors import RankError, RankTimeout, format_frames
from .plain import NotPlainError, to_plain
from .protocol import Failure, Frame, is_tensor

__all__ = ["NotPlainError"]

MAX_MESSAGE = 2000  # characters of an exception's message that cross


class RemoteError(Exception):
    """The exercise (or the driver calling it) failed on the other side of the boundary: what it raised, where.

    `types` are the exception's class names, most derived first (a test checks `ValueError` against them);
    `frames` are traceback lines of the learner's own cells; `rank` is None for a call in the kernel."""

    def __init__(self, info: dict):
        info = info if isinstance(info, dict) else {}
        self.info = info
        self.types: list[str] = [str(t) for t in (info.get("types") or [info.get("type", "Exception")])]
        self.type_name: str = self.types[0]
        self.message: str = str(info.get("message", ""))
        self.headline: str = str(info.get("headline") or f"{self.type_name}: {self.message}".rstrip(": "))
        rank = info.get("rank")
        self.rank: int | None = rank if type(rank) is int else None
        self.timeout: bool = info.get("timeout") is True
        self.frames: list[str] = [str(f) for f in (info.get("frames") or [])]
        self.case = ""  # which call of the test this was, filled in by the test's side
        super().__init__(self.headline)

    def is_a(self, exc_type: type[BaseException]) -> bool:
        return exc_type.__name__ in self.types

    @property
    def unfilled(self) -> bool:
        """The exercise still raises the blank stub's `NotImplementedError()`."""
        return self.type_name == "NotImplementedError" and not self.message.strip()


def failure(type_name: str, headline: str) -> RemoteError:
    """A failure of the other side that is not an exception of the learner's (no reply, a reply refused)."""
    return RemoteError({"type": type_name, "types": [type_name], "message": headline, "headline": headline})


# -- failures as data -------------------------------------------------------------------------------------------

def describe(exc: BaseException, is_cell: Callable[[str], bool] = lambda filename: False) -> dict:
    """An exception as data: type names, message, rank, and the learner's own frames (those in notebook cells)."""
    if isinstance(exc, RankTimeout):
        frames = []
        for rank, stack in exc.stacks.items():
            frames += _cell_frames(f"Your code on rank {rank}, where it was waiting", stack, is_cell)
        return {"type": "RankTimeout", "types": ["RankTimeout"], "message": exc.headline, "headline": exc.headline,
                "rank": exc.rank, "timeout": True, "frames": frames}
    if isinstance(exc, RankError):
        failure = exc.failure
        if failure is None:  # the rank died
            return {"type": "RankError", "types": ["RankError"], "message": exc.headline, "headline": exc.headline,
                    "rank": exc.rank, "frames": [line for line in exc.details[:12]]}
        message = _message(failure)
        return {"type": failure.type_name, "types": [failure.type_name], "message": message[:MAX_MESSAGE],
                "headline": f"rank {exc.rank} raised {failure.headline}"[:MAX_MESSAGE], "rank": exc.rank,
                "frames": _cell_frames(f"Your code on rank {exc.rank}", failure.frames, is_cell)}
    frames = [Frame(f.filename, f.lineno or 0, f.name, f.line or "") for f in traceback.extract_tb(exc.__traceback__)]
    types = [c.__name__ for c in type(exc).__mro__ if c not in (object, BaseException)]
    message = str(exc)
    return {"type": type(exc).__name__, "types": types, "message": message[:MAX_MESSAGE],
            "headline": f"{type(exc).__name__}: {message}"[:MAX_MESSAGE].rstrip(": "),
            "frames": _cell_frames("Your code", frames, is_cell)}


def _message(failure: Failure) -> str:
    return failure.message.split(":", 1)[1].strip() if ":" in failure.message else ""


def _cell_frames(title: str, frames: list[Frame], is_cell: Callable[[str], bool]) -> list[str]:
    mine = [f for f in frames if is_cell(f.filename)]
    return [f"{title} (most recent call last):", *format_frames(mine)] if mine else []


# -- the exercise, and references to what may cross ---------------------------------------------------------

class Exercise:
    """A test's handle on the exercise `name`: calling it is a request across `boundary`."""

    def __init__(self, name: str, boundary: Boundary, kind: str):
        self.name, self.boundary, self.kind = name, boundary, kind
        self.__name__ = name

    def __call__(self, *args, **kwargs) -> Any:
        return self.boundary.call(self, args, kwargs)

    def __repr__(self) -> str:
        return self.name


def reference(obj: Any) -> dict | None:
    """How `obj` is named across the boundary (None if it is plain data): the exercise, a partial, or a function or
    class of an importable module (the package's drivers, torch's functions)."""
    if isinstance(obj, Exercise):
        return {"__ref__": "exercise", "name": obj.name}
    if isinstance(obj, functools.partial):
        return {"__ref__": "partial", "fn": obj.func, "args": obj.args, "kwargs": obj.keywords}
    if callable(obj) and not is_tensor(obj):
        module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        if module and name and "<" not in name:
            try:
                if functools.reduce(getattr, name.split("."), importlib.import_module(module)) is obj:
                    return {"__ref__": "import", "module": module, "name": name}
            except (ImportError, AttributeError):
                pass
        raise TypeError(f"{getattr(obj, '__name__', obj)!r} cannot cross to the notebook: a test passes data, the "
                        "exercise, or functions of the package (its drivers) and of torch")
    return None


def to_wire(value: Any) -> Any:
    """A request's arguments: plain data, with references in place of callables."""
    ref = reference(value)
    if ref is not None:
        if ref["__ref__"] == "partial":
            return {**ref, "fn": to_wire(ref["fn"]), "args": to_wire(ref["args"]), "kwargs": to_wire(ref["kwargs"])}
        return ref
    if isinstance(value, (list, tuple)):
        return type(value)(to_wire(v) for v in value)
    if isinstance(value, dict):
        return {k: to_wire(v) for k, v in value.items()}
    return to_plain(value, name="an argument")


def resolve(value: Any, exercises: dict[str, Any]) -> Any:
    """The receiving side of `to_wire`: references replaced by the objects they name (`exercises` by name)."""
    if isinstance(value, dict) and "__ref__" in value:
        kind = value["__ref__"]
        if kind == "exercise":
            return exercises[value["name"]]
        if kind == "partial":
            return functools.partial(resolve(value["fn"], exercises), *resolve(value["args"], exercises),
                                     **resolve(value["kwargs"], exercises))
        if kind == "import":
            return functools.reduce(getattr, value["name"].split("."), importlib.import_module(value["module"]))
        raise ValueError(f"unknown reference {kind!r}")
    if isinstance(value, list):
        return [resolve(v, exercises) for v in value]
    if isinstance(value, tuple):
        return tuple(resolve(v, exercises) for v in value)
    if isinstance(value, dict):
        return {k: resolve(v, exercises) for k, v in value.items()}
    return value


# -- the requests ----------------------------------------------------------------------------------------------

class Boundary:
    """What a test may ask of the exercise; replies are plain data, failures `RemoteError`s."""

    traffic: list[list[int]] | None = None  # after `run`: bytes rank s received from rank r, or None (not measured)
    memory: int | None = None  # after `run`: the ranks' peak memory together, above where it began (None: unknown)

    def begin(self, names: Sequence[str]) -> dict[str, dict]:
        raise NotImplementedError

    def call(self, fn: Any, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError

    def call_each(self, fn: Any, cases: list) -> list:
        raise NotImplementedError

    def run(self, world_size: int, fn: Any, args: tuple, kwargs: dict, per_rank: list[tuple],
            timeout: float, fresh: bool = False) -> list:
        """`fresh`: on ranks started anew for this run."""
        raise NotImplementedError


def unpack(reply: Any) -> Any:
    """A reply's value, or its failure raised as `RemoteError`; a reply of another shape is refused."""
    if isinstance(reply, dict) and set(reply) == {"ok"}:
        return reply["ok"]
    if isinstance(reply, dict) and set(reply) == {"error"}:
        raise RemoteError(reply["error"])
    raise failure("NotPlainError", "the notebook's reply is not one the test asked for")


def rank_requests(fn: Any, args: tuple, kwargs: dict, per_rank: list[tuple]) -> list[dict]:
    """What each rank is asked: the driver, the shared arguments and that rank's own, as data."""
    return [to_wire({"fn": fn, "args": (*args, *mine), "kwargs": dict(kwargs)}) for mine in per_rank]


def exercises_named(wired: Any) -> set[str]:
    """The exercises a request (`to_wire`'s form) refers to."""
    if isinstance(wired, dict):
        if wired.get("__ref__") == "exercise":
            return {wired["name"]}
        return set().union(*(exercises_named(v) for v in wired.values()))
    if isinstance(wired, (list, tuple)):
        return set().union(*(exercises_named(v) for v in wired))
    return set()

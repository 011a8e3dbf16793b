"""The trust boundary: how a test reaches an exercise, and what may come back.

A test cell (`%%test NAME`) never holds the exercise itself. It holds an `Exercise` handle, and every use of the
exercise is a request across a `Boundary`:

- `begin(names)`: what each exercise is (a function, a class, a value and which), on fresh test ranks;
- `call(fn, args, kwargs)`: call it (or a driver that calls it) in the kernel;
- `call_each(fn, cases)`: many calls in one request;
- `run(world_size, fn, args, kwargs, timeout)`: a driver on every rank of a test cluster (`checks.run`); the
  grader first asks for the ranks to be `ready`, so that what it measures of a run is the run's alone.

What comes back is plain data only: None, booleans, numbers, strings, bytes, tensors, dtypes, and lists, tuples
and dicts of them (plus fractions and the package's dataclasses, rebuilt by the receiver from their fields). It
travels as `torch.save` bytes and is read with `torch.load(weights_only=True)`, which runs no code of the sender.
A failure comes back as data too (`RemoteError`): the exception's type names, its message, the rank, and the
lines of the learner's own cells in its traceback.

Two boundaries implement the same requests:
- `InProcess`: the learner's own `%%test` cell, in the notebook's kernel (the visible tests);
- the grader's (grading/grader.py): hidden and visible tests run in the grader's process, which runs no code of
  the student's, and each request crosses to the sandboxed kernel as a message (`%cs336_call`), served here by
  `serve`. Arguments are plain data or references by name (the exercise, a driver of a `%%test_helpers` cell, a
  function of torch or of the package), never code.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import importlib
import inspect
import io
import traceback
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

import torch

from . import testranks
from .errors import RankError, RankTimeout, format_frames
from .protocol import Failure, Frame

RESULT_MIME = "application/vnd.cs336.result+base64"  # how the kernel's reply reaches the grader
MAX_RESULT_BYTES = 256 * 2**20  # a reply larger than this is refused, not decoded
MAX_MESSAGE = 2000  # characters of an exception's message that cross


class NotPlainError(TypeError):
    """A value that is not plain data (it could compare equal to anything, or run code when read)."""


class RemoteError(Exception):
    """The exercise (or the driver calling it) failed on the other side of the boundary: what it raised, where.

    `types` are the exception's class names, most derived first (a test checks `ValueError` against them);
    `frames` are traceback lines of the learner's own cells; `rank` is None for a call in the kernel."""

    def __init__(self, info: dict):
        self.info = info
        self.types: list[str] = list(info.get("types") or [info.get("type", "Exception")])
        self.type_name: str = self.types[0]
        self.message: str = info.get("message", "")
        self.headline: str = info.get("headline") or f"{self.type_name}: {self.message}".rstrip(": ")
        self.rank: int | None = info.get("rank")
        self.timeout: bool = bool(info.get("timeout"))
        self.frames: list[str] = list(info.get("frames") or [])
        self.case = ""  # which call of the test this was, filled in by the test's side
        super().__init__(self.headline)

    def is_a(self, exc_type: type[BaseException]) -> bool:
        return exc_type.__name__ in self.types

    @property
    def unfilled(self) -> bool:
        """The exercise still raises the blank stub's `NotImplementedError()`."""
        return self.type_name == "NotImplementedError" and not self.message.strip()


# -- plain data -------------------------------------------------------------------------------------------------

_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


def to_plain(value: Any, *, name: str = "the result") -> Any:
    """`value` rebuilt from plain types only, ready for `encode`: subclasses of the builtins become their base
    value, a Parameter a tensor, a fraction or a dataclass of the package a tagged dict; anything else (an object
    whose `==` could be anything, a tensor subclass, a numpy array) raises NotPlainError."""
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is torch.Size:
        return tuple(value)
    if _is_numpy_scalar(value):
        return _numpy_scalar(value)
    if isinstance(value, int):  # a subclass (an IntEnum, a number that claims to equal anything): its value
        return int.__index__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, str):
        return str.__str__(value)
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        with torch._C.DisableTorchFunctionSubclass():
            return torch.Tensor.detach(value).cpu()
    if kind is Fraction:
        return {"__fraction__": (value.numerator, value.denominator)}
    if isinstance(value, list):
        return [to_plain(v, name=name) for v in list.__iter__(value)]
    if isinstance(value, tuple):
        return tuple(to_plain(v, name=name) for v in tuple.__iter__(value))
    if isinstance(value, dict):
        return {to_plain(k, name=name): to_plain(v, name=name) for k, v in dict.items(value)}
    if dataclasses.is_dataclass(kind) and kind.__module__.startswith("cs336_parallel."):
        fields = {f.name: to_plain(object.__getattribute__(value, f.name), name=name)
                  for f in dataclasses.fields(kind) if f.init}
        return {"__dataclass__": f"{kind.__module__}:{kind.__qualname__}", "fields": fields}
    raise NotPlainError(f"{name} is a {kind.__module__}.{kind.__qualname__}; a test compares only plain values "
                        "(numbers, strings, tensors, and lists, tuples and dicts of them)")


def _is_numpy_scalar(value: Any) -> bool:
    return type(value).__module__ == "numpy" and hasattr(value, "item") and getattr(value, "ndim", None) == 0


def _numpy_scalar(value: Any) -> Any:
    """A numpy number as the Python number it holds (numpy.int64 -> int): honest code returns them."""
    item = value.item()
    if type(item) not in (bool, int, float, complex):
        raise NotPlainError(f"a numpy {type(value).__name__} is not a number")
    return item


def from_plain(value: Any) -> Any:
    """The receiver's side of `to_plain`: tagged fractions and package dataclasses rebuilt (by this process's own
    classes, from plain fields), everything else as it is."""
    if isinstance(value, list):
        return [from_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(from_plain(v) for v in value)
    if not isinstance(value, dict):
        return value
    if set(value) == {"__fraction__"}:
        numerator, denominator = value["__fraction__"]
        return Fraction(int(numerator), int(denominator))
    if set(value) == {"__dataclass__", "fields"} and isinstance(value["__dataclass__"], str):
        module, _, qualname = value["__dataclass__"].partition(":")
        if not module.startswith("cs336_parallel."):
            raise NotPlainError(f"{module} is not the package's")
        cls = functools.reduce(getattr, qualname.split("."), importlib.import_module(module))
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise NotPlainError(f"{value['__dataclass__']} is not a dataclass of the package")
        return cls(**{k: from_plain(v) for k, v in value["fields"].items()})
    return {from_plain(k): from_plain(v) for k, v in value.items()}


def encode(value: Any) -> bytes:
    """Plain data (after `to_plain`) as bytes."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def decode(data: bytes) -> Any:
    """The value `encode` made, read without running any of the sender's code (`weights_only`)."""
    if len(data) > MAX_RESULT_BYTES:
        raise NotPlainError(f"the reply is {len(data) / 2**20:.0f} MB, more than the {MAX_RESULT_BYTES >> 20} MB "
                            "a test reads")
    return from_plain(torch.load(io.BytesIO(data), weights_only=True))


def round_trip(value: Any, *, name: str = "the result") -> Any:
    """What the other side of the boundary would receive: `InProcess` gives tests exactly what the grader gets."""
    return decode(encode(to_plain(value, name=name)))


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


def reference(obj: Any, helpers: dict[int, str]) -> dict | None:
    """How `obj` is named across the boundary (None if it is plain data): the exercise, a driver or value of a
    `%%test_helpers` cell (`helpers`: id -> name), a partial of one, or a function or class of an importable module."""
    if isinstance(obj, Exercise):
        return {"__ref__": "exercise", "name": obj.name}
    if id(obj) in helpers:
        return {"__ref__": "helper", "name": helpers[id(obj)]}
    if isinstance(obj, functools.partial):
        return {"__ref__": "partial", "fn": obj.func, "args": obj.args, "kwargs": obj.keywords}
    if callable(obj) and not isinstance(obj, torch.Tensor):
        module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        if module and name and "<" not in name:
            try:
                if functools.reduce(getattr, name.split("."), importlib.import_module(module)) is obj:
                    return {"__ref__": "import", "module": module, "name": name}
            except (ImportError, AttributeError):
                pass
        raise TypeError(f"{getattr(obj, '__name__', obj)!r} cannot cross to the kernel: a test passes data, the "
                        "exercise, or drivers defined in a %%test_helpers cell")
    return None


def to_wire(value: Any, helpers: dict[int, str]) -> Any:
    """A request's arguments for the kernel: plain data, with references in place of callables."""
    ref = reference(value, helpers)
    if ref is not None:
        if ref["__ref__"] == "partial":
            return {**ref, "fn": to_wire(ref["fn"], helpers), "args": to_wire(ref["args"], helpers),
                    "kwargs": to_wire(ref["kwargs"], helpers)}
        return ref
    if isinstance(value, (list, tuple)):
        return type(value)(to_wire(v, helpers) for v in value)
    if isinstance(value, dict):
        return {k: to_wire(v, helpers) for k, v in value.items()}
    return to_plain(value, name="an argument")


def resolve(value: Any, exercises: dict[str, Any], helpers: dict[str, Any]) -> Any:
    """The kernel's side of `to_wire`: references replaced by the objects they name."""
    if isinstance(value, dict) and "__ref__" in value:
        kind = value["__ref__"]
        if kind == "exercise":
            return exercises[value["name"]]
        if kind == "helper":
            if value["name"] not in helpers:
                raise NameError(f"{value['name']} is not defined: run the %%test_helpers cell that defines it")
            return helpers[value["name"]]
        if kind == "partial":
            return functools.partial(resolve(value["fn"], exercises, helpers),
                                     *resolve(value["args"], exercises, helpers),
                                     **resolve(value["kwargs"], exercises, helpers))
        if kind == "import":
            return functools.reduce(getattr, value["name"].split("."), importlib.import_module(value["module"]))
        raise ValueError(f"unknown reference {kind!r}")
    if isinstance(value, list):
        return [resolve(v, exercises, helpers) for v in value]
    if isinstance(value, tuple):
        return tuple(resolve(v, exercises, helpers) for v in value)
    if isinstance(value, dict):
        return {k: resolve(v, exercises, helpers) for k, v in value.items()}
    return from_plain(value)


# -- the two sides of a request --------------------------------------------------------------------------------

class Boundary:
    """What a test may ask of the exercise; replies are plain data, failures `RemoteError`s."""

    traffic: int | None = None  # bytes the last `run` moved on the ranks' network, measured outside (None: unknown)

    def begin(self, names: Sequence[str]) -> dict[str, dict]:
        raise NotImplementedError

    def call(self, fn: Any, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError

    def call_each(self, fn: Any, cases: list) -> list:
        raise NotImplementedError

    def run(self, world_size: int, fn: Any, args: tuple, kwargs: dict, timeout: float) -> list:
        raise NotImplementedError


def unpack(reply: dict) -> Any:
    """A reply's value, or its failure raised as `RemoteError`."""
    if "error" in reply:
        raise RemoteError(reply["error"])
    return reply["ok"]


class KernelSide:
    """Serves requests in the process that holds the exercises (the notebook's kernel): `exercises` are the
    notebook's names, `helpers` what the `%%test_helpers` cells defined; `is_cell` tells a notebook cell's file."""

    def __init__(self, exercises: dict, helpers: dict, is_cell: Callable[[str], bool] = lambda filename: False):
        self.exercises, self.helpers, self.is_cell = exercises, helpers, is_cell

    def handle(self, request: dict) -> dict:
        """The reply to `request` (its arguments already resolved), as plain data: {"ok": value} or {"error": info}."""
        kind = request["kind"]
        try:
            if kind == "begin":
                return {"ok": self.begin(request["names"])}
            if kind == "call":
                return {"ok": to_plain(request["fn"](*request["args"], **request["kwargs"]))}
            if kind == "call_each":
                return {"ok": [self.handle({"kind": "call", "fn": request["fn"], "args": tuple(args), "kwargs": {}})
                               for args in request["cases"]]}
            if kind == "ready":  # the ranks join their group now, not during the next request
                testranks.test_ranks(request["world_size"])
                return {"ok": None}
            if kind == "run":
                results = testranks.run_on_test_ranks(request["world_size"], request["fn"], request["args"],
                                                   request["kwargs"], request["timeout"])
                return {"ok": [to_plain(r, name=f"the result of rank {i}") for i, r in enumerate(results)]}
            raise ValueError(f"unknown request {kind!r}")
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - the learner's failure is the reply
            return {"error": describe(exc, self.is_cell)}

    def begin(self, names: Sequence[str]) -> dict[str, dict]:
        found = {}
        for name in names:
            obj = self.exercises.get(name, _MISSING)
            if obj is _MISSING:
                found[name] = {"kind": "missing"}
            elif inspect.isclass(obj):
                found[name] = {"kind": "class"}
            elif callable(obj):
                found[name] = {"kind": "function"}
            else:
                found[name] = {"kind": "value", "value": to_plain(obj, name=f"`{name}`")}
        testranks.fresh_ranks(tuple((n, id(self.exercises.get(n))) for n in names))
        return found

    def serve(self, payload: str) -> str:
        """A request from the grader (base64 of `encode`), answered as base64 of the encoded reply."""
        request = resolve(decode(base64.b64decode(payload)), self.exercises, self.helpers)
        reply = self.handle(request)
        try:
            data = encode(reply)
        except Exception as exc:  # noqa: BLE001 - e.g. a tensor torch cannot save
            data = encode({"error": describe(exc)})
        return base64.b64encode(data).decode("ascii")


_MISSING = object()


class InProcess(Boundary):
    """The learner's `%%test` cell: requests served in this process, replies passed through `round_trip` so a
    test sees exactly what the grader would."""

    def __init__(self, side: KernelSide):
        self.side = side

    def _request(self, request: dict) -> Any:
        request = {k: self._local(v) for k, v in request.items()}
        reply = self.side.handle(request)
        try:
            reply = decode(encode(reply))
        except Exception as exc:  # noqa: BLE001
            reply = {"error": describe(exc)}
        return unpack(reply)

    def _local(self, value: Any) -> Any:
        if isinstance(value, Exercise):
            return self.side.exercises[value.name]
        if isinstance(value, functools.partial):
            return functools.partial(self._local(value.func), *self._local(value.args), **self._local(value.keywords))
        if isinstance(value, (list, tuple)):
            return type(value)(self._local(v) for v in value)
        if isinstance(value, dict):
            return {k: self._local(v) for k, v in value.items()}
        return value

    def begin(self, names: Sequence[str]) -> dict[str, dict]:
        return self._request({"kind": "begin", "names": list(names)})

    def call(self, fn: Any, args: tuple, kwargs: dict) -> Any:
        return self._request({"kind": "call", "fn": fn, "args": tuple(args), "kwargs": dict(kwargs)})

    def call_each(self, fn: Any, cases: list) -> list:
        return self._request({"kind": "call_each", "fn": fn, "cases": [tuple(c) for c in cases]})

    def run(self, world_size: int, fn: Any, args: tuple, kwargs: dict, timeout: float) -> list:
        return self._request({"kind": "run", "world_size": world_size, "fn": fn, "args": tuple(args),
                              "kwargs": dict(kwargs), "timeout": timeout})
